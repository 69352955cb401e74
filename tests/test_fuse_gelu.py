"""fuse_gelu: GELUs written out in elementwise ops (tanh and erf forms, in the orders models
write them) become one aten.gelu each, equal to eager; anything else is left alone."""
import math

import pytest
import torch
from torch import nn

import fxdream
from fxdream.ir.graphs import copy_graph_module
from fxdream.pass_api import PassContext
from fxdream.pass_registry import resolve_passes
from fxdream.passes import fuse_gelu

PASS = "fuse_gelu"
aten = torch.ops.aten
C = math.sqrt(2.0 / math.pi)


class Formula(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


FORMS = {
    # Hugging Face's NewGELUActivation (GPT-2's "gelu_new")
    "gpt2": (lambda x: 0.5 * x * (1.0 + torch.tanh(C * (x + 0.044715 * torch.pow(x, 3.0)))), "tanh"),
    # the same with the factors and terms in other orders, x³ as x * x * x
    "reordered": (lambda x: x * (torch.tanh((0.044715 * (x * x * x) + x) * C) + 1) * 0.5, "tanh"),
    "erf": (lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))), "none"),
    "erf_mul": (lambda x: 0.5 * (1.0 + torch.erf(x * (1 / math.sqrt(2.0)))) * x, "none"),
}


def gelu_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is aten.gelu.default]


def run_pass(fn, x=None):
    """The pass named on ``fn``'s captured forward, without costs."""
    x = torch.randn(4, 16) if x is None else x
    captured = fxdream.capture(Formula(fn).eval(), (x,))
    gm = copy_graph_module(captured.forward)
    return x, resolve_passes([PASS])[0](gm, PassContext(device="cpu"))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_each_written_out_form_becomes_one_gelu_equal_to_eager(form):
    fn, approximate = FORMS[form]
    x, result = run_pass(fn)
    assert result.modified and result.reason.startswith("1 GELU(s) written out in ")
    (gelu,) = gelu_nodes(result.graph_module)
    assert gelu.kwargs == {"approximate": approximate}
    computing = [n for n in result.graph_module.graph.nodes if n.op == "call_function"]
    assert computing == [gelu]  # the formula's ops are gone
    torch.testing.assert_close(result.graph_module(x)[0], fn(x), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fn", [
    lambda x: 0.5 * x * (1.0 + torch.tanh(0.8 * (x + 0.044715 * torch.pow(x, 3.0)))),   # another constant
    lambda x: 0.5 * x * (1.0 + torch.tanh(C * (x + 0.044715 * torch.pow(x, 2.0)))),     # x², not x³
    lambda x: 0.5 * x.t() * (1.0 + torch.erf(x.t() / math.sqrt(2.0))) + 0 * x.t(),     # an input of two nodes
])
def test_formulas_that_are_not_gelu_are_left_alone(fn):
    x = torch.randn(8, 8)
    _, result = run_pass(fn, x)
    assert not result.modified and result.reason == "no GELU written out in elementwise ops (tanh or erf form)"


def test_an_intermediate_read_elsewhere_keeps_the_formula():
    def fn(x):
        inner = torch.tanh(C * (x + 0.044715 * torch.pow(x, 3.0)))
        return 0.5 * x * (1.0 + inner), inner  # the tanh is an output too
    _, result = run_pass(fn)
    assert not result.modified


def test_under_auto_the_fused_gelu_becomes_the_linear_layers_post_op():
    torch.manual_seed(0)
    fn = FORMS["gpt2"][0]
    model = nn.Sequential(nn.Linear(32, 64), Formula(fn), nn.Linear(64, 16)).eval()
    x = torch.randn(2, 8, 32)
    optimized = fxdream.optimize(model, (x,), passes=[PASS, "prepack_linear"], cost=None)
    rows = {r.name: r for r in optimized.report.passes}
    assert rows[PASS].applied and rows["prepack_linear"].reason.endswith("1 with the activation fused")
    linear = [n for n in optimized.rewritten_graphs[(0, "fw")].graph.nodes
              if n.op == "call_function" and "linear_pointwise" in str(n.target)]
    assert [n.args[3:] for n in linear] == [("gelu", [], "tanh"), ("none", [], "")]
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("forced", [False, True])
def test_predicted_slower_it_declines_under_auto_and_applies_named(forced):
    x = torch.randn(4, 16)
    captured = fxdream.capture(Formula(FORMS["erf"][0]).eval(), (x,))
    answers = iter([10.0, 20.0])  # as captured, fused
    ctx = PassContext(device="cpu", predict_us=lambda gm: next(answers), forced=forced)
    result = resolve_passes([PASS])[0](copy_graph_module(captured.forward), ctx)
    if forced:
        assert result.modified and result.reason.endswith("(predicted: 0.010 → 0.020 ms, forced: not faster)")
    else:
        assert not result.modified and result.reason == "not faster in context (predicted: 0.010 → 0.020 ms)"
    assert bool(gelu_nodes(result.graph_module)) is forced


@pytest.mark.parametrize("training,phase", [(True, "fw"), (False, "bw")])
def test_applies_to_inference_forward_graphs_only(training, phase):
    reason = resolve_passes([PASS])[0].applies_to(PassContext(device="cpu", training=training, phase=phase))
    assert reason == fuse_gelu._FORWARD_ONLY


def test_a_training_build_leaves_the_formula_and_equals_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), Formula(FORMS["gpt2"][0]))
    x = torch.randn(4, 8, requires_grad=True)
    optimized = fxdream.optimize(model, (x,), passes=[PASS], training=True, cost=None)
    assert not any(r.applied for r in optimized.report.passes)
    torch.testing.assert_close(optimized(x), model(x))
