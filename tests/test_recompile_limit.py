"""A built module compiles a graph per new input shape past dynamo's default recompile limit (8),
leaves the process's limit as it was, and says so where its own limit is reached."""
import logging

import pytest
import torch
import torch.nn as nn

import fxdream
from fxdream.capturing import dynamo as dynamo_glue


class Net(nn.Module):  # a class of its own: its forward's dynamo cache holds these tests' entries only
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def _limit_name():
    config = torch._dynamo.config
    return "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"


@pytest.mark.parametrize("training", [True, False])
def test_every_new_batch_size_compiles_past_dynamos_default_limit(training):
    torch.manual_seed(0)
    model = Net().train(training)
    fast = fxdream.optimize(model, (torch.randn(2, 3, 8, 8),), training=training, cost=None)
    with torch._dynamo.config.patch(**{_limit_name(): 8}):
        for batch in range(3, 14):
            x = torch.randn(batch, 3, 8, 8)
            graphs = len(fast.report.graphs)
            with torch.set_grad_enabled(training):
                out = fast(x)
            assert len(fast.report.graphs) == graphs + 1, batch  # a graph of its own, not eager
            assert getattr(torch._dynamo.config, _limit_name()) == 8
    assert not any("its limit" in note for note in fast.report.notes)
    if not training:
        torch.testing.assert_close(out, model(x))


@pytest.mark.parametrize("logged", [True, False])
def test_reaching_the_raised_limit_is_said(monkeypatch, logged):
    """Read from dynamo's cache: with dynamo's warnings silenced too."""
    monkeypatch.setattr(dynamo_glue, "RAISED_RECOMPILE_LIMIT", 3)
    if not logged:
        monkeypatch.setattr(logging.getLogger("torch._dynamo"), "disabled", True)
    model = Net().train()
    with torch._dynamo.config.patch(**{_limit_name(): 3}):
        fast = fxdream.optimize(model, (torch.randn(2, 3, 8, 8),), training=True, cost=None)
        for batch in range(3, 7):
            fast(torch.randn(batch, 3, 8, 8)).sum().backward()
        notes = [n for n in fast.report.notes if "its limit" in n]
    assert len(notes) == 1 and notes[0].startswith("dynamo's cache for 'forward' (")
    assert "holds 3 compilations, its limit" in notes[0] and "run eagerly from now on" in notes[0]


def _raised_from(filename: str) -> BaseException:
    scope = {}
    exec(compile("def fail():\n    raise AssertionError('sources must not be empty for symbol s29')\n",
                 filename, "exec"), scope)
    try:
        scope["fail"]()
    except AssertionError as error:
        return error


def test_an_error_inside_dynamos_frame_conversion_is_a_compilation_failure():
    """An assertion while dynamo builds a recompilation's guards is not a TorchDynamoException:
    the fallback reason must not blame the rewritten graphs for it."""
    convert_frame = torch._dynamo.convert_frame.__file__
    assert dynamo_glue.raised_compiling(_raised_from(convert_frame))
    assert not dynamo_glue.raised_compiling(_raised_from("model.py"))
    assert dynamo_glue.raised_compiling(torch._dynamo.exc.Unsupported("no"))
