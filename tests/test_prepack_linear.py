"""prepack_linear: linear layers as oneDNN's packed linear (with ReLU/GELU as its post-op) in
CPU inference, where measured faster; equal to eager; declines and says why otherwise."""
import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

import fxdream
from fxdream.ir.graphs import copy_graph_module
from fxdream import models
from fxdream.pass_api import PassContext
from fxdream.pass_registry import resolve_passes
from fxdream.passes import prepack_linear as pack
from fxdream.sim.cost.profiled import Profiled
from fxdream.sim.cost.devices import DEVICES

PASS = "prepack_linear"


class Mlp(nn.Module):
    """Linear+ReLU, Linear+GELU (tanh) on a 3-d input (a view between), a bias-less Linear."""

    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8, bias=False)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        h = nn.functional.gelu(self.fc2(h), approximate="tanh")
        return self.fc3(h) * 2


def linear_nodes(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is pack.LINEAR]


def test_packs_every_linear_and_fuses_its_activation_without_measured_costs():
    torch.manual_seed(0)
    model, x = Mlp().eval(), torch.randn(2, 5, 16)
    optimized = fxdream.optimize(model, (x,), passes=[PASS], cost=None)
    (row,) = optimized.report.passes
    assert row.applied and row.reason == "packed 3 of 3 linear layer(s) (3 by oneDNN), 2 with the activation fused"
    graph = optimized.rewritten_graphs[(0, "fw")]
    assert [n.args[3:] for n in linear_nodes(graph)] == [("relu", [], ""), ("gelu", [], "tanh"), ("none", [], "")]
    remaining = {n.target for n in graph.graph.nodes if n.op == "call_function"}
    assert not remaining & {torch.ops.aten.addmm.default, torch.ops.aten.mm.default, torch.ops.aten.relu.default,
                            torch.ops.aten.gelu.default, torch.ops.aten.t.default}
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), atol=1e-5, rtol=1e-5)


def test_the_packed_weights_count_in_the_predicted_peak_memory():
    # they live beside the model's own weights: memory_budget must see them
    torch.manual_seed(0)
    model, x = Mlp().eval(), torch.randn(2, 5, 16)
    optimized = fxdream.optimize(model, (x,), passes=[PASS], cost="analytic")
    (row,) = optimized.report.passes
    packed = [b for name, b in optimized.rewritten_graphs[(0, "fw")].named_buffers() if name.endswith("packed_weight")]
    assert row.applied and len(packed) == 3
    assert row.predicted_delta_peak_bytes >= sum(b.numel() * b.element_size() for b in packed) > 0


def test_one_row_is_left_alone_without_measured_costs_and_the_reason_says_so():
    model, x = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval(), torch.randn(1, 8)
    optimized = fxdream.optimize(model, (x,), passes=[PASS], cost=None)
    (row,) = optimized.report.passes
    assert not row.applied and row.reason == ("packing is not faster at any of the 1 linear layer(s) "
                                              "(no measured costs: none has more than one row)")
    assert row.notes == ("0: no measured costs: left as it was (1 row: packing was slower here)",)


class TimedAlone(Profiled):
    """A Profiled cost model whose isolated timings are given: oneDNN's packed op ``packed_us``,
    MKL's ``mkl_us``, addmm 10 µs, the rest 0."""

    def __init__(self, packed_us: float, mkl_us: float = 100.0):
        super().__init__(DEVICES["cpu"])
        self.us = {pack.LINEAR: packed_us, pack.MKL_LINEAR: mkl_us, pack.ADDMM: 10.0}

    def isolated_us(self, node):
        return self.us.get(node.target, 0.0)


def run_pass(model, x, cost_model, predicted: list, forced: bool = False):
    """The pass on ``model``'s captured forward, ``predict_us`` answering ``predicted`` in turn
    (as under ``passes="auto"`` unless ``forced``: named by the user)."""
    captured = fxdream.capture(model, (x,))
    names = [n.name for n in captured.forward.graph.nodes if n.op == "placeholder"]
    params = dict(zip(names, captured.example_inputs[:2]))  # weight, bias (the live parameters)
    answers = iter(predicted)
    ctx = PassContext(device="cpu", params=params, cost_model=cost_model, predict_us=lambda gm: next(answers),
                      forced=forced)
    return captured, resolve_passes([PASS])[0](copy_graph_module(captured.forward), ctx)


@pytest.mark.parametrize("packed_us,applied", [(1.0, True), (10.0, False)])
def test_a_site_is_packed_only_where_its_packed_op_is_faster_alone(packed_us, applied):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval(), torch.randn(4, 8)
    # in context (unpacked, then packed) packing wins too
    captured, result = run_pass(model, x, TimedAlone(packed_us), [100.0, 50.0])
    assert result.modified is applied
    assert result.notes[0] == (f"0: 4 rows, 8 → 4 + relu: as captured 10 µs, oneDNN {packed_us:.0f} µs (MKL's packed "
                               "buffer would exceed 4x the weight) (alone) → "
                               + ("packed by oneDNN" if applied else "left as it was"))
    if applied:
        assert result.reason == ("packed 1 of 1 linear layer(s) (1 by oneDNN), 1 with the activation fused "
                                 "(predicted: 0.100 → 0.050 ms)")
        with torch.no_grad():
            torch.testing.assert_close(result.graph_module(*captured.example_inputs)[0], model(x))


def test_mkl_is_chosen_where_faster_and_its_buffer_small_enough_and_keeps_the_activation():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()).eval(), torch.randn(4, 1024)  # MKL: 3.3x
    captured, result = run_pass(model, x, TimedAlone(5.0, mkl_us=2.0), [100.0, 50.0])
    assert result.modified and result.reason.startswith("packed 1 of 1 linear layer(s) (1 by MKL) (predicted")
    assert result.notes[0].endswith("as captured 10 µs, oneDNN 5 µs, MKL 2 µs (alone) → packed by MKL")
    targets = [n.target for n in result.graph_module.graph.nodes if n.op == "call_function"]
    assert targets == [pack.MKL_LINEAR, torch.ops.aten.relu.default]  # MKL's op has no post-ops
    with torch.no_grad():
        torch.testing.assert_close(result.graph_module(*captured.example_inputs)[0], model(x), atol=1e-4, rtol=1e-5)


def test_a_torch_without_mkl_packs_with_onednn_and_says_so(monkeypatch):
    monkeypatch.setattr(pack, "MKL_LINEAR", None)  # what ops.optional_op gives on a build without MKL
    model, x = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU()).eval(), torch.randn(4, 1024)
    _, result = run_pass(model, x, TimedAlone(5.0, mkl_us=2.0), [100.0, 50.0])
    assert result.modified and "(1 by oneDNN)" in result.reason
    assert result.notes[0].endswith("oneDNN 5 µs (no MKL in this torch) (alone) → packed by oneDNN")


def test_declines_when_the_graph_is_not_faster_in_context():
    model, x = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval(), torch.randn(4, 8)
    _, result = run_pass(model, x, TimedAlone(1.0), [100.0, 150.0])
    assert not result.modified and result.reason == "not faster in context (predicted: 0.100 → 0.150 ms)"


def test_named_explicitly_it_packs_and_applies_where_predicted_slower_and_says_so():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 4), nn.ReLU()).eval(), torch.randn(4, 8)
    captured, result = run_pass(model, x, TimedAlone(20.0), [100.0, 150.0], forced=True)
    assert result.modified and result.reason.endswith("(predicted: 0.100 → 0.150 ms, forced: not faster)")
    assert result.notes[0].endswith("oneDNN 20 µs (MKL's packed buffer would exceed 4x the weight) (alone) → "
                                    "packed by oneDNN (forced: slower alone)")
    with torch.no_grad():
        torch.testing.assert_close(result.graph_module(*captured.example_inputs)[0], model(x))


@pytest.mark.parametrize("training,device,reason", [
    (True, "cpu", "inference forward graphs only (the weights must be constants)"),
    (False, "cuda", "CPU only (oneDNN's packed linear)")])
def test_applies_to_cpu_inference_only(training, device, reason):
    assert resolve_passes([PASS])[0].applies_to(PassContext(device=device, training=training)) == reason


@pytest.mark.parametrize("name", ["mnist_convnet", "vgg19", "bert_base"])
def test_zoo_models_equal_eager(name):
    model, inputs, _ = models.build(name, 2, tiny=True)
    model.eval()
    optimized = fxdream.optimize(model, inputs, passes=["fuse_conv_bias_act", PASS], cost=None)
    assert optimized.report.passes[-1].applied
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs), model(*inputs), atol=1e-4, rtol=1e-4)


def test_packed_linears_count_the_matmul_flops():
    x, w = torch.randn(6, 16), torch.randn(32, 16)
    counts = []
    for run in (lambda: pack.LINEAR(x, torch.ops.mkldnn._reorder_linear_weight(w, 6), None, "none", [], ""),
                lambda: pack.MKL_LINEAR(x, torch.ops.mkl._mkl_reorder_linear_weight(w, 6), w, None, 6)):
        with FlopCounterMode(display=False) as counter:
            run()
        counts.append(counter.get_total_flops())
    assert counts == [2 * 6 * 16 * 32] * 2  # the analytic cost model reads these


class Conv1D(nn.Module):
    """Hugging Face's GPT-2 layer: the weight stored as (in, out), ``addmm(b, x, w)`` without a ``t``."""

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(nx, nf) * 0.1), nn.Parameter(torch.randn(nf))

    def forward(self, x):
        out = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return out.view(x.size()[:-1] + (self.weight.shape[1],))


class GatedMlp(nn.Module):
    """A Conv1D layer, then a Llama-style gated MLP: silu(gate(h)) * up(h)."""

    def __init__(self):
        super().__init__()
        self.proj, self.gate, self.up = Conv1D(64, 32), nn.Linear(64, 48), nn.Linear(64, 48)

    def forward(self, x):
        h = self.proj(x)
        return nn.functional.silu(self.gate(h)) * self.up(h)


def test_weights_stored_in_out_are_packed_transposed_and_silu_becomes_the_post_op():
    torch.manual_seed(0)
    model, x = GatedMlp().eval(), torch.randn(2, 8, 32)
    optimized = fxdream.optimize(model, (x,), passes=[PASS], cost=None)
    (row,) = optimized.report.passes
    assert row.reason == "packed 3 of 3 linear layer(s) (3 by oneDNN), 1 with the activation fused"
    graph = optimized.rewritten_graphs[(0, "fw")]
    assert [n.args[3] for n in linear_nodes(graph)] == ["none", "swish", "none"]
    packed = dict(graph.named_buffers())
    assert sorted(tuple(b.shape) for b in packed.values()) == [(48, 64), (48, 64), (64, 32)]  # (out, in)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), atol=1e-5, rtol=1e-5)


def test_a_transposed_weight_packed_by_mkl_gets_a_t_whose_value_the_timing_alone_reads():
    # MKL's op reads the (out, in) weight: the pass adds a ``t`` of the stored (in, out) one; the
    # op timed alone is called on that node's value (without it, it fell back to a roofline guess)
    torch.manual_seed(0)
    model, x = Conv1D(1024, 1024).eval(), torch.randn(4, 1024)
    captured, result = run_pass(model, x, TimedAlone(5.0, mkl_us=2.0), [100.0, 50.0])
    assert result.modified and "(1 by MKL)" in result.reason
    targets = [n.target for n in result.graph_module.graph.nodes if n.op == "call_function"]
    assert [t for t in targets if t is not torch.ops.aten.view.default] == [torch.ops.aten.t.default, pack.MKL_LINEAR]
    t = next(n for n in result.graph_module.graph.nodes if n.target is torch.ops.aten.t.default)
    assert tuple(t.meta["val"].shape) == (1024, 1024) and t.meta["val"].stride() == (1, 1024)
    with torch.no_grad():
        torch.testing.assert_close(result.graph_module(*captured.example_inputs)[0], model(x), atol=1e-4, rtol=1e-5)
