"""Fitted GPU parameters: roofline shares per kernel class, fitting them to measured times,
and the fits a DeviceSpec takes from fxdream/sim/cost/fits."""
import json
import operator

import pytest
import torch

from conftest import graph_with_values
from fxdream.ir.flops import kernel_class
from fxdream.sim.cost.analytic import Analytic
from fxdream.sim.cost.devices import (
    FITS_DIR,
    DeviceSpec,
    datasheet_device,
    get_device,
    parameters_of,
    with_parameters,
)
from fxdream.sim.cost.fitting import fit_parameters
from fxdream.sim.prediction import graph_prediction

aten = torch.ops.aten
# 1 TFLOP/s, 1 GB/s: a 1000x1000 fp32 relu moves 8 MB = 8000 µs; dispatch 1 µs, launch 2 µs
TOY = DeviceSpec("toy-gpu", "cuda", {"float32": 1e12}, 1e9, launch_overhead_us=2.0, dispatch_overhead_us=1.0,
                 kernel_min_us=3.0, num_sms=4, memory_bytes=2**30)


def _relu_then_mm(graph, x, w):
    relu = graph.call_function(aten.relu.default, (x,))
    view = graph.call_function(aten.view.default, (relu, [1000, 1000]))
    return graph.call_function(aten.mm.default, (view, w))


def _nodes(gm):
    return {n.target: n for n in gm.graph.nodes if n.op == "call_function"}


def test_kernel_classes():
    gm = graph_with_values(_relu_then_mm, (1000, 1000), (1000, 1000))
    nodes = _nodes(gm)
    assert kernel_class(nodes[aten.relu.default]) == "other" and kernel_class(nodes[aten.mm.default]) == "gemm"

    def conv(graph, x, w):
        return graph.call_function(aten.convolution.default, (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1))
    conv_gm = graph_with_values(conv, (1, 2, 4, 4), (3, 2, 1, 1))
    assert kernel_class(_nodes(conv_gm)[aten.convolution.default]) == "conv"


def test_a_share_divides_the_roofline_of_its_class_only():
    gm = graph_with_values(_relu_then_mm, (1000, 1000), (1000, 1000))
    nodes = _nodes(gm)
    half_other = with_parameters(TOY, {"roofline_share.other": 0.5})
    relu, mm = nodes[aten.relu.default], nodes[aten.mm.default]
    assert Analytic(TOY).kernel_us(relu) == pytest.approx(8000.0)       # 8 MB at 1 GB/s
    assert Analytic(half_other).kernel_us(relu) == pytest.approx(16000.0)
    # mm: 2e9 FLOP = 2000 µs, 12 MB = 12000 µs: memory-bound, its share (gemm) untouched
    assert Analytic(half_other).kernel_us(mm) == Analytic(TOY).kernel_us(mm) == pytest.approx(12000.0)
    assert half_other.share("gemm") == 1.0 and half_other.share("other") == 0.5


def test_a_getitem_costs_no_dispatch():
    def split(graph, x):
        parts = graph.call_function(aten.split.Tensor, (x, 2))
        return graph.call_function(operator.getitem, (parts, 0))
    gm = graph_with_values(split, (4, 3))
    getitem = next(n for n in gm.graph.nodes if n.target is operator.getitem)
    assert Analytic(TOY).dispatch_us(getitem) == 0.0


def test_a_host_factor_scales_the_host_cost_of_its_class_only():
    gm = graph_with_values(_relu_then_mm, (1000, 1000), (1000, 1000))
    nodes = _nodes(gm)
    slow_gemm = with_parameters(TOY, {"host_factor.gemm": 4.0})
    relu, view, mm = nodes[aten.relu.default], nodes[aten.view.default], nodes[aten.mm.default]
    assert Analytic(slow_gemm).dispatch_us(mm) == pytest.approx(1.0 + 4 * 2.0)  # dispatch + launch x 4
    assert Analytic(slow_gemm).dispatch_us(relu) == Analytic(TOY).dispatch_us(relu) == pytest.approx(3.0)
    assert Analytic(slow_gemm).dispatch_us(view) == pytest.approx(1.0)  # a view launches nothing
    assert slow_gemm.host_us("conv") == 3.0 and slow_gemm.host_us("gemm") == 9.0


def test_parameters_are_validated():
    with pytest.raises(ValueError, match="not fittable DeviceSpec parameters: \\['peak_flops'\\]"):
        with_parameters(TOY, {"peak_flops": 1.0})
    with pytest.raises(ValueError, match="roofline_share values must be in \\(0, 1\\]"):
        with_parameters(TOY, {"roofline_share.conv": 1.5})
    with pytest.raises(ValueError, match="host_factor values must be positive"):
        with_parameters(TOY, {"host_factor.conv": 0.0})
    with pytest.raises(ValueError, match="measured times must be positive"):
        fit_parameters(TOY, ["kernel_min_us"], lambda spec: [1.0], [0.0])
    with pytest.raises(ValueError, match="parameters to fit must be among"):
        fit_parameters(TOY, ["num_sms"], lambda spec: [1.0], [1.0])
    with pytest.raises(ValueError, match="2 weights for 1 measured cases"):
        fit_parameters(TOY, ["kernel_min_us"], lambda spec: [1.0], [1.0], weights=[1.0, 2.0])


def _many_small_ops(graph, x):
    for _ in range(20):
        x = graph.call_function(aten.relu.default, (x,))
        x = graph.call_function(aten.view.default, (x, [-1]))
    return x


def test_the_fit_recovers_the_parameters_that_made_the_measurements():
    """Three graphs simulated with known parameters are the "measurements"; a fit from the
    datasheet-like start finds those parameters again: a host-bound chain of tiny ops (launch
    and dispatch), the same chain with views only half as many (separates the two), and a big
    relu + mm (the shares of "other"; "gemm" is not fitted and stays 1.0)."""
    graphs = [graph_with_values(_many_small_ops, (4,)),
              graph_with_values(lambda g, x: g.call_function(aten.relu.default, (x,)), (4,)),
              graph_with_values(_relu_then_mm, (1000, 1000), (1000, 1000))]
    truth = with_parameters(TOY, {"dispatch_overhead_us": 7.0, "launch_overhead_us": 11.0, "kernel_min_us": 3.0,
                                  "roofline_share.other": 0.25})

    def evaluate(spec):
        return [graph_prediction(gm, Analytic(spec))[0] / 1e3 for gm in graphs]
    measured = evaluate(truth)
    names = ("dispatch_overhead_us", "launch_overhead_us", "roofline_share.other")
    result = fit_parameters(TOY, names, evaluate, measured, min_step=0.001)
    expected = {"dispatch_overhead_us": 7.0, "launch_overhead_us": 11.0, "roofline_share.other": 0.25}
    for name in names:
        assert result.parameters[name] == pytest.approx(expected[name], rel=0.02), name
    assert all(abs(e) < 0.5 for e in result.errors_pct)


def test_a_gpu_with_a_fit_file_takes_its_parameters():
    fit = json.loads((FITS_DIR / "h200.json").read_text())
    fitted, datasheet = get_device("h200"), datasheet_device("h200")
    assert parameters_of(fitted, tuple(fit["parameters"])) == pytest.approx(fit["parameters"])
    assert fitted.source.startswith("fitted to ") and datasheet.source == "datasheet"
    assert datasheet.share("conv") == 1.0 and datasheet.dispatch_overhead_us == 1.5
    assert fitted.peak_flops == datasheet.peak_flops and fitted.memory_bytes == datasheet.memory_bytes
    assert get_device("h100").source == "datasheet"           # a fit applies to its own device only
    with pytest.raises(ValueError, match="no datasheet GPU 'cpu'"):
        datasheet_device("cpu")
