"""Fitted GPU parameters: roofline shares per kernel class, fitting them to measured times,
and the fits a DeviceSpec takes from fxdream/sim/cost/fits."""
import dataclasses
import json
import operator

import pytest
import torch

import fxdream
from conftest import graph_with_values
from fxdream.ir.flops import kernel_bytes, kernel_class, kernel_count, traffic_factor
from fxdream.ir.nodes import node_bytes
from fxdream.sim.cost.analytic import Analytic
from fxdream.sim.cost.devices import (
    FITS_DIR,
    DeviceSpec,
    datasheet_device,
    get_device,
    parameters_of,
    with_fit,
    with_parameters,
)
from fxdream.sim.cost.fitting import fit_parameters
from fxdream.sim.cost.occupancy import OccupancyAware
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
    # a pointwise (1x1) convolution is a GEMM over the positions: a class of its own
    pointwise = graph_with_values(conv, (1, 2, 4, 4), (3, 2, 1, 1))
    assert kernel_class(_nodes(pointwise)[aten.convolution.default]) == "conv_1x1"
    spatial = graph_with_values(conv, (1, 2, 4, 4), (3, 2, 3, 1))
    assert kernel_class(_nodes(spatial)[aten.convolution.default]) == "conv"

    def conv_backward(graph, grad, x, w):
        return graph.call_function(aten.convolution_backward.default, (grad, x, w, [3], [1, 1], [0, 0], [1, 1],
                                                                        False, [0, 0], 1, [True, True, True]))
    backward = graph_with_values(conv_backward, (1, 3, 4, 4), (1, 2, 4, 4), (3, 2, 1, 1))
    assert kernel_class(_nodes(backward)[aten.convolution_backward.default]) == "conv_1x1"


def test_a_pointwise_convolution_takes_its_own_classs_share_and_float32_runs_at_tf32():
    def conv(graph, x, w):
        return graph.call_function(aten.convolution.default, (x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1))
    node = _nodes(graph_with_values(conv, (8, 64, 14, 14), (64, 64, 1, 1)))[aten.convolution.default]
    spec = dataclasses.replace(get_device("h100"), roofline_share={"conv": 0.25, "conv_1x1": 0.5},
                               kernel_startup_us={}, kernel_min_us=0.0)
    flops = 2 * 8 * 14 * 14 * 64 * 64
    traffic = node_bytes(node)
    roofline_us = max(flops / spec.peak_flops["tf32"], traffic / spec.mem_bandwidth) * 1e6
    assert Analytic(spec).kernel_us(node) == pytest.approx(roofline_us / 0.5)


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


def _conv_backward(graph, grad, x, w, mask=(True, True, False)):
    return graph.call_function(aten.convolution_backward.default,
                               (grad, x, w, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1, list(mask)))


def test_a_conv_backward_and_its_parts_one_per_kernel_move_alike():
    """Each kernel of a convolution_backward reads grad_output, input and weight: the fused call
    moves what its data-gradient and weight-gradient parts move together."""
    def three(graph, grad, x, w):
        return tuple(_conv_backward(graph, grad, x, w, mask) for mask in
                     ((True, True, False), (True, False, False), (False, True, False)))
    gm = graph_with_values(three, (2, 8, 4, 4), (2, 8, 4, 4), (8, 8, 1, 1))
    fused, dgrad, wgrad = [n for n in gm.graph.nodes if n.op == "call_function"]
    inputs = 4 * (2 * 8 * 16 * 2 + 64)  # grad_output, input, weight (float32)
    assert kernel_bytes(fused) == node_bytes(fused) + inputs
    assert kernel_bytes(fused) == kernel_bytes(dgrad) + kernel_bytes(wgrad)


def test_a_startup_adds_to_each_kernel_of_its_class():
    """Startup 10 µs for pointwise convolutions: a conv backward launches a kernel per gradient in its
    output mask (data and weight here), so it takes two startups; the floor applies per kernel."""
    gm = graph_with_values(_conv_backward, (1, 8, 4, 4), (1, 8, 4, 4), (8, 8, 1, 1))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    assert kernel_count(node) == 2 and kernel_class(node) == "conv_1x1"
    started = with_parameters(TOY, {"kernel_startup_us.conv_1x1": 10.0})
    bare = Analytic(TOY).kernel_us(node)
    assert bare == pytest.approx(2 * 3.0)  # tiny work: two kernels at the 3 µs floor
    assert Analytic(started).kernel_us(node) == pytest.approx(2 * 10.0 + kernel_bytes(node) / 1e9 * 1e6)
    # the roofline part divides by the share, the startup does not
    assert started.kernel_time_us(0, 1e6, kernel_class="conv_1x1") == pytest.approx(10.0 + 1000.0)
    halved = with_parameters(started, {"roofline_share.conv_1x1": 0.5})
    assert halved.kernel_time_us(0, 1e6, kernel_class="conv_1x1") == pytest.approx(10.0 + 2000.0)
    assert halved.kernel_time_us(0, 1e6, kernel_class="other") == pytest.approx(1000.0)  # its class only


def test_batch_norm_traffic_is_float32_and_read_twice_in_training():
    """A half-precision batch norm costs the traffic of float32 elements; in training the forward
    and backward cost their training factors more (traffic_factor); other ops their bytes."""
    def norms(graph, x, w, b, mean, var):
        half = graph.call_function(aten._to_copy.default, (x,), {"dtype": torch.float16})
        infer = graph.call_function(aten._native_batch_norm_legit_no_training.default, (x, w, b, mean, var, 0.1, 1e-5))
        train = graph.call_function(aten.native_batch_norm.default, (x, w, b, mean, var, True, 0.1, 1e-5))
        flagged_off = graph.call_function(aten.native_batch_norm.default, (x, w, b, mean, var, False, 0.1, 1e-5))
        return half, infer, train, flagged_off
    gm = graph_with_values(norms, (2, 3, 4, 4), (3,), (3,), (3,), (3,))
    half, infer, train, flagged_off = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert kernel_bytes(half) == node_bytes(half) and kernel_bytes(infer) == node_bytes(infer)
    assert kernel_bytes(train) == pytest.approx(node_bytes(train) * traffic_factor("aten._native_batch_norm_legit_"
                                                                                  "functional", "float32"))
    assert kernel_bytes(flagged_off) == node_bytes(flagged_off)  # its training flag says inference
    assert traffic_factor("aten._native_batch_norm_legit_no_training", "float16") == 2.0
    assert traffic_factor("aten.native_batch_norm_backward", "bfloat16") == 2 * traffic_factor(
        "aten.native_batch_norm_backward", "float32") > 2
    assert traffic_factor("aten.relu", "float16") == 1.0


def test_a_fill_model_is_not_added_to_kernels_fitted_to_measurements():
    """A datasheet spec's roofline assumes a full device, so the occupancy model divides a
    convolution by its fill; a spec fitted to measured kernels has the fill in its shares."""
    def conv(graph, x, w):
        return graph.call_function(aten.convolution.default, (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1))
    gm = graph_with_values(conv, (1, 256, 64, 64), (256, 256, 3, 3))
    node = next(n for n in gm.graph.nodes if n.op == "call_function")
    sheet = datasheet_device("h200")
    measured = dataclasses.replace(sheet, kernels_measured=True)
    assert OccupancyAware(Analytic(measured)).kernel_us(node) == pytest.approx(Analytic(measured).kernel_us(node))
    # 4096 x 256 outputs in 128 x 128 tiles: 64 blocks on 132 SMs; the roofline (~10 µs) is above the floor
    assert Analytic(sheet).kernel_us(node) > 5 * sheet.kernel_min_us
    assert OccupancyAware(Analytic(sheet)).kernel_us(node) == pytest.approx(Analytic(sheet).kernel_us(node) * 132 / 64)
    assert get_device("h200").kernels_measured and not sheet.kernels_measured


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
    with pytest.raises(ValueError, match="kernel_startup_us values must be >= 0"):
        with_parameters(TOY, {"kernel_startup_us.conv": -1.0})
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
    h100, h100_datasheet = get_device("h100"), datasheet_device("h100")  # the same SMs: the H200's fit
    assert parameters_of(h100, tuple(fit["parameters"])) == pytest.approx(fit["parameters"])
    assert h100.mem_bandwidth == h100_datasheet.mem_bandwidth == 3.35e12 and h100.kernels_measured
    assert "h100's own datasheet peaks, bandwidth and memory" in h100.source
    # other SMs, not measured: the fit as a default (host costs per op, the kernels' efficiency),
    # with their own datasheet peaks, bandwidth and memory
    for name in ("a100", "v100"):
        other, other_datasheet = get_device(name), datasheet_device(name)
        assert parameters_of(other, tuple(fit["parameters"])) == pytest.approx(fit["parameters"])
        assert other.peak_flops == other_datasheet.peak_flops and other.mem_bandwidth == other_datasheet.mem_bandwidth
        assert other.kernels_measured and "not measured on this GPU" in other.source
    with pytest.raises(ValueError, match="no datasheet GPU 'cpu'"):
        datasheet_device("cpu")


def test_an_analytic_prediction_ranges_over_the_errors_its_fit_was_checked_with(tmp_path):
    rows = [{"measured_ms": 9.0, "fitted_ms": 10.0}, {"measured_ms": 12.0, "fitted_ms": 10.0}]
    path = tmp_path / "fit.json"
    path.write_text(json.dumps({"parameters": {}, "fitted_on": "two cases", "fit": rows[:1], "held_out": rows[1:]}))
    spec = with_fit(datasheet_device("h200"), path)
    assert spec.error_ratios == pytest.approx((0.9, 1.2))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU())
    p = fxdream.simulate(model, (torch.randn(4, 64),), device=spec)
    assert p.time_ms_range == pytest.approx((0.9 * p.time_ms, 1.2 * p.time_ms))
    assert f"{p.time_ms:.3f} ms ({0.9 * p.time_ms:.3f}–{1.2 * p.time_ms:.3f})" in p.summary()
    # the same SMs take the fit's errors; another generation has no measurement to take them from
    assert get_device("h100").error_ratios == get_device("h200").error_ratios is not None
    assert get_device("v100").error_ratios is None and datasheet_device("h200").error_ratios is None
    v100 = fxdream.simulate(model, (torch.randn(4, 64),), device="v100")
    assert v100.range_ms is None and "no range: no measurement of this GPU" in v100.summary()
