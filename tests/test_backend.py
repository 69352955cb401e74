import pytest
import torch
import torch.nn as nn
from torch._dynamo.utils import counters
from conftest import assert_step_matches

from fxdream.ir.nodes import op_name
from fxdream.pass_api import PassResult, register_pass


class MulByOne(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x) * 1.0


@register_pass
class FoldMulByOneForBackend:
    name = "test_backend_fold_mul_by_one"

    def applies_to(self, ctx):
        return None if ctx.phase == "fw" else "forward only"

    def __call__(self, gm, ctx):
        nodes = [n for n in gm.graph.nodes if op_name(n) == "aten.mul" and n.args[1] == 1.0]
        for node in nodes:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        return PassResult(gm, bool(nodes), f"folded {len(nodes)}")


def test_fxdream_is_a_registered_torch_compile_backend():
    assert "fxdream" in torch._dynamo.list_backends(exclude_tags=())
    model, x = MulByOne(), torch.randn(2, 4)
    compiled = torch.compile(model, backend="fxdream")
    torch.testing.assert_close(compiled(x), model(x))


def test_backend_options_choose_passes_and_report_rows():
    model, x = MulByOne(), torch.randn(2, 4)
    rows = []
    compiled = torch.compile(model, backend="fxdream", options={
        "passes": ["test_backend_fold_mul_by_one"], "cost": "analytic", "on_report": rows.append})
    out = compiled(x)
    out.sum().backward()
    torch.testing.assert_close(out, model(x))
    assert [(r.phase, r.applied, r.reason) for r in rows] == [("fw", True, "folded 1"),
                                                             ("bw", False, "forward only")]
    assert rows[0].predicted_delta_us < 0


def test_unknown_backend_option_is_named():
    compiled = torch.compile(MulByOne(), backend="fxdream", options={"pases": ["x"]})
    with pytest.raises(Exception, match=r"unknown fxdream option\(s\) \['pases'\]; valid options: passes"):
        compiled(torch.randn(2, 4))


@pytest.mark.parametrize("options, message", [({"cost": "bogus"}, r"cost='bogus' is not a cost model; valid: 'auto'"),
                                             ({"device": "h900"}, r"device='h900' is not a device; valid here: cpu")])
def test_a_bad_cost_or_device_option_is_named(options, message):
    compiled = torch.compile(MulByOne(), backend="fxdream", options=options)
    with pytest.raises(Exception, match=message):
        compiled(torch.randn(2, 4))


def test_an_inductor_mode_is_named_as_such():
    compiled = torch.compile(MulByOne(), backend="fxdream", mode="max-autotune")
    with pytest.raises(Exception, match=r"mode='max-autotune' is inductor's; fxdream takes options="):
        compiled(torch.randn(2, 4))


class ScaledBySizedOnes(nn.Module):
    """A factory op sized by the batch: symbolic once dynamo recompiles for a second batch size."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        scale = torch.ones(y.shape[0], 1, 1, 1) * 2
        return y * scale * torch.sigmoid(nn.functional.adaptive_avg_pool2d(y, 1))


def test_dynamic_shapes_are_costed_at_their_example_sizes():
    """dynamo's recompile with a symbolic batch gives graphs with SymInt sizes: the measured
    cost model times them at the sizes they were traced at (was: a crash materializing them)."""
    torch.manual_seed(0)
    model = ScaledBySizedOnes().train()
    eager = ScaledBySizedOnes().train()
    eager.load_state_dict(model.state_dict())
    compiled = torch.compile(model, backend="fxdream", options={"passes": "auto"})
    for shape, channels_last in (((2, 3, 8, 8), False), ((3, 3, 8, 8), False), ((2, 3, 8, 8), True)):
        x = torch.randn(shape)
        if channels_last:
            x = x.contiguous(memory_format=torch.channels_last)
        assert_step_matches(compiled, model, eager, x)


def test_a_dynamic_inference_graph_is_timed_on_its_example_sizes_without_tracebacks(capfd):
    # dynamo hands the backend its symbolic sizes as SymInt inputs: the timed runs take their values
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, 4)).eval()
    rows = []
    options = {"passes": ["fuse_conv_bias_act"], "on_report": rows.append}
    compiled = torch.compile(model, backend="fxdream", options=options)
    with torch.no_grad():
        for batch in (2, 5, 7):
            x = torch.randn(batch, 3, 16, 16)
            torch.testing.assert_close(compiled(x), model(x))
    assert len(rows) >= 2 and all(r.applied for r in rows)  # from the second graph on: a symbolic batch
    assert "SymIntArrayRef" not in capfd.readouterr().err


class ConvPoolHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.bn = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.pool(torch.relu(self.bn(self.conv(x)))).flatten(1))


@pytest.mark.parametrize("passes", [["fuse_conv_bias_act"], ["prepack_linear"], "auto"])
def test_a_dynamic_batch_stays_dynamic_through_the_passes(passes):
    """A pass or the simulator reading a symbolic size as an int would fix it for the whole graph:
    dynamo then raises for a dimension marked dynamic, and compiles a graph per size otherwise."""
    torch._dynamo.reset()
    counters.clear()
    model = ConvPoolHead().eval()
    compiled = torch.compile(model, backend="fxdream", options={"passes": passes})
    with torch.no_grad():
        for batch in (2, 3, 5):
            x = torch.randn(batch, 3, 12, 12)
            torch._dynamo.mark_dynamic(x, 0)
            torch.testing.assert_close(compiled(x), model(x), atol=1e-5, rtol=1e-5)
    assert counters["stats"]["unique_graphs"] == 1
