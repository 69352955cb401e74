"""A measured prediction's graph time rescaled to the module's own graph calls, timed after the build."""
import pytest
import torch

import fxdream
from fxdream.capturing.host_gaps import END, StepCalls
from fxdream.sim.cost.run_spread import RunSpread
from fxdream.sim.lower import lower
from fxdream.sim.measured_scale import graph_scale, rescaled_ms
from fxdream.sim.prediction import Prediction
from fxdream.sim.simulate import simulate
from conftest import graph_with_values
from test_sim_lower import CPU, GPU, FixedCost, _relu_view_add


def _prediction(device, gap_us: float, range_ms=None) -> Prediction:
    """One graph of relu 1+10, view 1, add 1+10 µs (23 µs on a CPU) after a host gap of ``gap_us``."""
    fw = graph_with_values(_relu_view_add, (4,))
    graph = lower([("g0.fw", fw)], FixedCost(device), host_gaps={"g0.fw": gap_us, END: 0.0}).graph
    return Prediction(device, True, graph, simulate(graph), 0, range_ms=range_ms)


def test_the_graphs_are_scaled_by_their_calls_measured_time_and_the_gaps_stay():
    prediction = _prediction(CPU, gap_us=77.0, range_ms=(0.090, 0.110))  # 0.1 ms: 77 µs of gap, 23 of graph
    step = StepCalls(("g0.fw", "g9.fw"), (77.0, 5.0), 0.0, calls_us=(46.0, 1000.0))  # g9: not a captured graph
    scale = graph_scale(step, prediction, {"g0.fw"})
    assert scale == pytest.approx(2.0)
    time_ms, (low, high) = rescaled_ms(prediction, scale)
    assert time_ms == pytest.approx(0.077 + 2 * 0.023)
    # the graph part of the range scaled too, and widened by the drift the scale shows (2x); the gaps stay
    assert (low, high) == (pytest.approx(0.077 + 2 * 0.013 / 2), pytest.approx(0.077 + 2 * 0.033 * 2))


def test_the_range_is_widened_by_how_far_the_scale_moved_either_way():
    prediction = _prediction(CPU, gap_us=77.0, range_ms=(0.090, 0.110))
    for scale in (1.1, 1 / 1.1):  # slower or faster after the build: the same drift
        time_ms, (low, high) = rescaled_ms(prediction, scale)
        assert (low, high) == (pytest.approx(0.077 + scale * 0.013 / 1.1),
                               pytest.approx(0.077 + scale * 0.033 * 1.1))


def test_no_scale_without_timed_calls_or_on_a_gpu():
    untimed = StepCalls(("g0.fw",), (77.0,), 0.0)
    assert graph_scale(untimed, _prediction(CPU, 77.0), {"g0.fw"}) is None
    timed = StepCalls(("g0.fw",), (77.0,), 0.0, calls_us=(46.0,))
    assert graph_scale(timed, _prediction(GPU, 77.0), {"g0.fw"}) is None  # a GPU call returns before its kernels


def test_a_training_build_scales_its_prediction_by_the_modules_measured_graph_calls():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    report = fxdream.optimize(model, (torch.randn(16, 64),), passes="auto", training=True, eager_check=False).report
    (note,) = [n for n in report.notes if n.startswith("the graphs' times measured during the build are scaled by")]
    scale = float(note.split("scaled by ")[1].split(":")[0])
    assert 0.2 < scale < 5.0  # the same graphs, timed twice on one machine
    low, high = report.predicted_optimized_ms_range
    assert low <= report.predicted_optimized_ms <= high


def test_the_gaps_range_is_the_spread_of_the_measured_steps():
    prediction = _prediction(CPU, gap_us=77.0, range_ms=(0.090, 0.110))
    steady = StepCalls(("g0.fw",), (77.0,), 0.0, calls_us=(23.0,), steps_us=(100.0, 100.0))
    assert rescaled_ms(prediction, 1.0, steady)[1] == (pytest.approx(0.090), pytest.approx(0.110))
    spread = StepCalls(("g0.fw",), (77.0,), 0.0, calls_us=(23.0,), steps_us=(90.0, 100.0, 110.0))
    bounds = RunSpread.of_runs(frozenset(), [90.0, 100.0, 110.0])  # ±10 % over three runs, widened
    low, high = rescaled_ms(prediction, 1.0, spread)[1]
    assert (low, high) == (pytest.approx(0.077 * bounds.low + 0.013), pytest.approx(0.077 * bounds.high + 0.033))
    assert bounds.low < 0.9 and bounds.high > 1.1


def test_the_range_holds_the_spread_of_the_measured_steps_where_the_graphs_ops_spread_less():
    prediction = _prediction(CPU, gap_us=77.0, range_ms=(0.099, 0.101))  # ops side by side: ±1 %
    spread = StepCalls(("g0.fw",), (77.0,), 0.0, calls_us=(23.0,), steps_us=(90.0, 100.0, 110.0))
    bounds = RunSpread.of_runs(frozenset(), [90.0, 100.0, 110.0])
    low, high = rescaled_ms(prediction, 1.0, spread)[1]
    assert (low, high) == (pytest.approx(0.1 * bounds.low), pytest.approx(0.1 * bounds.high))


def test_an_inference_build_on_a_cpu_scales_its_prediction_by_the_modules_measured_calls():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval()
    report = fxdream.optimize(model, (torch.randn(16, 64),), passes="auto", eager_check=False).report
    assert any(n.startswith("the graphs' times measured during the build are scaled by") for n in report.notes)
    assert any(n.startswith("measured host time outside the graphs (the module's call around its graph)")
               for n in report.notes)
    low, high = report.predicted_optimized_ms_range
    assert low <= report.predicted_optimized_ms <= high
