import pytest
import torch
import torch.fx as fx
import torch.nn as nn


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    """Each test compiles and profiles from scratch: no cache entries, counters or measured
    costs left by another test, and no profile directory from the environment."""
    from fxdream.sim.profile.store import PROFILE_DIR_ENV, forget_profiles
    torch._dynamo.reset()
    forget_profiles()
    monkeypatch.delenv(PROFILE_DIR_ENV, raising=False)
    yield


@pytest.fixture(autouse=True)
def quiet_machine(monkeypatch):
    """Builds see a quiet machine: what the report says does not depend on what else runs
    beside the tests (tests/test_disturbed_measurements.py sets the load it tests)."""
    import contextlib

    import fxdream.build as build
    from fxdream.sim.profile.machine_load import LoadWatch

    @contextlib.contextmanager
    def quiet():
        yield LoadWatch(foreign_cpu_s=0.0, window_s=1.0)
    monkeypatch.setattr(build, "watch_machine_load", quiet)


@pytest.fixture
def no_tf32():
    """Convolutions in full fp32: cuDNN's TF32 default (Ampere and later) lets two runs of one
    conv that pick different algorithms differ by ~1e-3 relative (seen on an H200)."""
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        yield


def assert_same_training_step(model, optimized, inputs, loss_fn=None, atol=1e-5, rtol=1e-4):
    """Outputs and every parameter's gradient equal between eager ``model`` and ``optimized``."""
    import copy
    reference = copy.deepcopy(model)
    for m in (reference, optimized):
        m.zero_grad(set_to_none=True)
    torch.manual_seed(0)
    expected = reference(*inputs)
    torch.manual_seed(0)
    actual = optimized(*inputs)
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol)
    loss = loss_fn or (lambda out: sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(out)))
    loss(expected).backward()
    loss(actual).backward()
    checked = 0
    for (name, p_ref), p_opt in zip(reference.named_parameters(), optimized.model.parameters()):
        if p_ref.grad is None:
            assert p_opt.grad is None, name
            continue
        torch.testing.assert_close(p_opt.grad, p_ref.grad, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
        checked += 1
    return checked


def assert_step_matches(run, model, reference, *inputs, atol=1e-5, rtol=1e-4):
    """One training step through ``run`` (on ``model``'s parameters) and through ``reference``
    (an equal copy, eager): outputs, every gradient and every buffer (BN statistics) equal."""
    out, expected = run(*inputs), reference(*inputs)
    torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    out.sum().backward()
    expected.sum().backward()
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=atol, rtol=rtol)
    for b, c in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(b, c, atol=atol, rtol=rtol)


class RecordValues(fx.Interpreter):
    """Runs a graph on real tensors and keeps each value as meta["val"] (shapes for the cost models)."""
    def run_node(self, node):
        node.meta["val"] = result = super().run_node(node)
        return result


def graph_with_values(build, *shapes) -> fx.GraphModule:
    """A GraphModule from ``build(graph, *placeholders)`` (its output), run once on random
    inputs of ``shapes`` so every node has meta["val"]."""
    graph = fx.Graph()
    inputs = [graph.placeholder(f"x{i}") for i in range(len(shapes))]
    graph.output(build(graph, *inputs))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    RecordValues(gm).run(*[torch.randn(s) for s in shapes])
    return gm


class TwoSubgraphs(torch.nn.Module):
    """Two linear layers with a graph break between them: two captured subgraphs."""
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2)

    def forward(self, x):
        h = self.first(x)
        torch._dynamo.graph_break()
        return self.second(h)


class ConvBnNet(nn.Module):
    """conv (no bias) → BatchNorm → ReLU → pooled linear head: what BN folding and the fusion take."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))
