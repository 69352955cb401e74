"""Every prediction carries a range: simulated with each op at the fastest and the slowest of
its measured in-context samples (hand-computed on a two-op graph), shown in the report."""
import dataclasses

import pytest
import torch

from fxdream.ab import ABResult, ABRow
from fxdream.measure import Measurement
from fxdream.report import PassReport, Report
from fxdream.sim.cost import Analytic, Profiled, get_device
from fxdream.sim.cost.spread import SpreadBound
from fxdream.sim.lower import lower
from fxdream.sim.prediction import Prediction, iteration_us, repeated
from fxdream.sim.profile.op_keys import profile_key
from fxdream.sim.simulate import simulate
from fxdream.sim.task import DepKind, Task, TaskKind
from fxdream.sim.taskgraph import TaskGraph
from conftest import graph_with_values


def _relu_then_sigmoid():
    def build(graph, x):
        a = graph.call_function(torch.ops.aten.relu.default, (x,))
        return graph.call_function(torch.ops.aten.sigmoid.default, (a,))
    return graph_with_values(build, (4, 4))


def _measured(gm) -> Profiled:
    """A profiled model with in-context samples set by hand (nothing is timed)."""
    cost = Profiled(get_device("cpu"))
    relu, sigmoid = [n for n in gm.graph.nodes if n.op == "call_function"]
    for node, samples in ((relu, [1.0, 2.0, 3.0]), (sigmoid, [10.0, 20.0, 30.0])):
        key = profile_key(node, "cpu")
        cost.samples[key] = samples
        cost.measurements[key] = 2.0 if node is relu else 20.0
    cost._call_overhead_us = 0.0
    cost.measurements["__graph_call__|cpu"] = 0.0
    return cost


def _makespan(gm, cost) -> float:
    lowered = lower([("g.fw", gm)], cost)
    return simulate(lowered.graph).makespan_us


def test_each_bound_takes_the_fastest_or_slowest_sample_of_every_op():
    gm = _relu_then_sigmoid()
    cost = _measured(gm)
    relu, sigmoid = [n for n in gm.graph.nodes if n.op == "call_function"]
    low, high = SpreadBound(cost, "low"), SpreadBound(cost, "high")
    assert (low.kernel_us(relu), low.kernel_us(sigmoid)) == (1.0, 10.0)
    assert (high.kernel_us(relu), high.kernel_us(sigmoid)) == (3.0, 30.0)
    assert low.dispatch_us(relu) == cost.dispatch_us(relu)  # the rest is the measured model's
    middle = _makespan(gm, cost)
    assert _makespan(gm, low) == pytest.approx(middle - 1.0 - 10.0)
    assert _makespan(gm, high) == pytest.approx(middle + 1.0 + 10.0)
    with pytest.raises(ValueError, match="side='middle'; valid: 'low', 'high'"):
        SpreadBound(cost, "middle")


def test_an_unmeasured_prediction_has_a_zero_width_range():
    prediction = Prediction(get_device("h100"), False, None, type("T", (), {"makespan_us": 2000.0})(), 0)
    assert prediction.time_ms_range == (2.0, 2.0)
    assert Prediction(get_device("cpu"), False, None, None, 0, range_ms=(1.5, 2.5)).time_ms_range == (1.5, 2.5)


def test_the_report_shows_each_prediction_with_its_range_and_the_gain_with_its_own():
    report = Report(model="M", training=False, device="cpu", graphs=(), predicted_baseline_ms=84.0,
                    predicted_optimized_ms=42.0, predicted_baseline_ms_range=(80.0, 88.0),
                    predicted_optimized_ms_range=(40.0, 44.0), predicted_peak_delta_bytes=0)
    assert report.predicted_speedup == pytest.approx(2.0)
    assert report.predicted_speedup_range == pytest.approx((80.0 / 44.0, 88.0 / 40.0))
    text = str(report)  # print(report) shows the page, not the dataclass's fields
    assert text.startswith("## fxdream report: M (inference, cpu)")
    assert "84.000 ms (80.000–88.000) without passes → 42.000 ms (40.000–44.000) with them" in text
    assert "2.00x (1.82–2.20)" in text
    assert repr(report).startswith("Report(model='M'")


def test_the_gain_is_exactly_one_where_no_pass_rewrote_the_graphs():
    declined = PassReport("fuse_conv_bias_act", 0, "fw", False, "no convolution")
    report = Report(model="M", training=False, device="cpu", graphs=(), passes=(declined,),
                    predicted_baseline_ms=0.138, predicted_optimized_ms=0.138, predicted_peak_delta_bytes=0,
                    predicted_baseline_ms_range=(0.091, 0.442), predicted_optimized_ms_range=(0.091, 0.442))
    assert report.predicted_speedup_range == (1.0, 1.0)
    assert "(+0.0 %; 1.00x (1.00–1.00))" in report.to_markdown()
    applied = dataclasses.replace(report, passes=(dataclasses.replace(declined, applied=True),))
    assert applied.predicted_speedup_range == pytest.approx((0.091 / 0.442, 0.442 / 0.091))


def test_a_pass_applied_to_graphs_a_module_running_eagerly_does_not_run_is_marked_unused():
    row = PassReport("reinplace", 0, "fw", True, "1 op(s) now in place")
    report = Report(model="M", training=False, device="cpu", graphs=(), passes=(row,))
    assert "| reinplace | 0/fw | yes | 1 op(s) now in place |" in report.to_markdown()
    eager = dataclasses.replace(report, fallback_reason="measured slower than eager")
    assert "| reinplace | 0/fw | yes, unused (runs eagerly) | 1 op(s) now in place |" in eager.to_markdown()


def _row(optimized_ms: float, predicted_range, at_build_range=None):
    from fxdream.ab import ABRow
    from fxdream.measure import Measurement
    m = Measurement(optimized_ms, optimized_ms, optimized_ms, 5, 10)
    return ABRow("m", 1, False, ("p",), m, m, m, 10.0, 9.0, 0.0, (), 9.5, predicted_range, at_build_range)


def test_ab_rows_say_whether_the_measured_time_fell_in_its_range_and_the_result_counts_them():
    from fxdream.ab import ABResult
    rows = (_row(9.0, (8.0, 10.0), (9.5, 9.9)), _row(12.0, (8.0, 10.0), (11.0, 13.0)), _row(9.0, None))
    assert [r.in_range for r in rows] == [True, False, None]
    assert [r.in_range_at_build for r in rows] == [False, True, None]
    result = ABResult("cpu", "2.x", "today", rows)
    assert result.coverage() == pytest.approx(0.5) and result.coverage(at_build=True) == pytest.approx(0.5)
    text = result.to_markdown()
    assert "between the blocks 50 % (ranges ±11 % wide on average)" in text  # 2 / 9 ms wide: ±11 %
    assert "at build 50 % (ranges ±6 % wide on average) of 3 row(s)" in text  # (0.4 + 2) / 2 / 9.5 ms
    assert ABResult("cpu", "2.x", "today", (rows[2],)).coverage() is None


def test_timing_rounds_times_each_graph_that_many_times_and_keeps_every_round():
    import fxdream
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU()).eval()
    optimized = fxdream.optimize(model, (torch.randn(1, 3, 12, 12),), passes=["fuse_conv_bias_act"], timing_rounds=6)
    samples = optimized._cost_model.samples
    assert samples and all(len(times) == 6 for times in samples.values())  # no early stop, no faster-of-two
    low, high = optimized.report.predicted_optimized_ms_range
    assert low <= optimized.report.predicted_optimized_ms <= high
    with pytest.raises(ValueError, match="timing_rounds must be an integer ≥ 1, got 0"):
        fxdream.optimize(model, (torch.randn(1, 3, 12, 12),), timing_rounds=0)


def test_auto_keeps_the_simplest_candidate_within_the_fastest_ones_measured_spread():
    from fxdream.pass_api import PassContext
    from fxdream.pass_runner import PassPipeline
    from fxdream.sim.prediction import graph_prediction
    gm = _relu_then_sigmoid()
    cost = _measured(gm)
    pipeline = PassPipeline((), PassContext(cost_model=cost), auto=True)
    high = graph_prediction(gm, SpreadBound(cost, "high"), "fw")[0]  # the fastest one's slowest
    assert high > 20.0  # so that 5 % of the fastest is more than the 0.5 µs below
    fastest = (False, 0, high - 0.5, 2, ("fuse", "pack"), gm, [])
    tie = (False, 0, high - 0.1, 1, ("fuse",), gm, [])
    slower = (False, 0, high + 5.0, 0, (), gm, [])
    ordered, displaced = pipeline._simplest_of_ties([fastest, tie, slower], "fw")
    assert ordered[0] is tie and displaced is fastest and len(ordered) == 3
    clear = (False, 0, high + 0.2, 1, ("fuse",), gm, [])  # outside the spread: not a tie
    assert pipeline._simplest_of_ties([fastest, clear, slower], "fw") == ([fastest, clear, slower], None)
    much_faster = (False, 0, high / 2, 2, ("fuse", "pack"), gm, [])  # within the spread, 20 % behind it:
    behind = (False, 0, high * 0.6, 1, ("fuse",), gm, [])               # a gain not given up to noise
    assert pipeline._simplest_of_ties([much_faster, behind], "fw") == ([much_faster, behind], None)
    analytic = PassPipeline((), PassContext(cost_model=Analytic(get_device("cpu"))), auto=True)
    assert analytic._simplest_of_ties([fastest, tie], "fw") == ([fastest, tie], None)  # no measured spread


def test_a_run_spread_is_a_prediction_interval_scaled_from_the_measured_sides():
    from fxdream.sim.cost.run_spread import RunSpread
    keys = frozenset({"k"})
    # 3 runs, median 100: 2·1.645·√(1 + 1/3) / d₂(3) = 2.2439 times each measured side
    spread = RunSpread.of_runs(keys, [90.0, 100.0, 120.0])
    assert spread.low == pytest.approx(1 - 2.2439 * 0.10, abs=1e-4)
    assert spread.high == pytest.approx(1 + 2.2439 * 0.20, abs=1e-4)
    assert RunSpread.of_runs(keys, [100.0]) == RunSpread(keys, 1.0, 1.0)  # one run: no spread measured
    assert RunSpread.of_runs(keys, [0.0, 0.0]) is None
    assert RunSpread.of_runs(keys, [10.0, 100.0]).low == 0.05  # never at or below zero


def test_a_spread_of_many_runs_comes_from_their_quartiles_not_their_outlier():
    from fxdream.sim.cost.run_spread import RunSpread
    runs = [90.0, 95.0, 96.0, 98.0, 99.0, 100.0, 100.0, 101.0, 102.0, 104.0, 105.0, 300.0]  # one 3x step
    # median 100, quartiles 96.5 and 103.5; 1.645·√(1 + 1/12) / 0.6745 = 2.5384 times each side
    spread = RunSpread.of_runs(frozenset(), runs)
    assert spread.low == pytest.approx(1 - 2.5384 * 0.035, abs=1e-4)
    assert spread.high == pytest.approx(1 + 2.5384 * 0.035, abs=1e-4)


def _launch_chain(kernel_us: float, sync: bool = False) -> TaskGraph:
    """Three host launches of 4 µs, each launching a kernel of ``kernel_us`` on stream 0; with
    ``sync`` the host then waits for the last kernel (``.item()``)."""
    graph = TaskGraph()
    for i in range(3):
        graph.append(Task.cpu(f"L{i}", 4.0, op="aten.relu"))
        graph.append(Task.gpu(f"K{i}", kernel_us, op="aten.relu"), deps=[f"L{i}"])
    if sync:
        graph.append(Task("S", TaskKind.SYNC, 0.0, "cpu:0"), deps=[("K2", DepKind.SYNC)])
    return graph


@pytest.mark.parametrize("kernel_us, sync, expected_us", [
    (10.0, False, 30.0),   # device-bound: the stream's 3 x 10 µs, the next call's launches hidden
    (1.0, False, 12.0),    # host-bound: the 3 x 4 µs of launches
    (10.0, True, 34.0),    # the host waits each call: one call's makespan, 4 + 3 x 10 µs
])
def test_inference_calls_back_to_back_cost_their_busiest_resource(kernel_us, sync, expected_us):
    graph = _launch_chain(kernel_us, sync)
    timeline = simulate(graph)
    h100 = get_device("h100")
    assert iteration_us(h100, graph, timeline) == pytest.approx(expected_us)
    back_to_back = Prediction(h100, False, graph, timeline, 0, back_to_back=True)
    one_call = Prediction(h100, False, graph, timeline, 0)
    assert back_to_back.time_ms == pytest.approx(expected_us / 1e3)
    assert one_call.time_ms == pytest.approx(timeline.makespan_us / 1e3)
    assert one_call.time_ms >= back_to_back.time_ms
    assert iteration_us(get_device("cpu"), graph, timeline) == timeline.makespan_us  # a CPU runs both


def test_calls_back_to_back_overlap_the_work_before_a_wait_with_the_call_before():
    """A launches a 100 µs kernel, the host waits for it (a read), B launches a 50 µs kernel. One
    call: A 0-10, K1 10-110, wait, B 110-120, K2 120-170. The next call's A (120-130) runs while
    K2 does; its K1 starts when K2 ends (170-270), its B at 270, its K2 ends at 330: 160 µs a
    call, not one call's 170."""
    graph = TaskGraph()
    graph.append(Task.cpu("A", 10.0, op="aten.mm"))
    graph.append(Task.gpu("K1", 100.0, op="aten.mm"), deps=["A"])
    graph.append(Task("S", TaskKind.SYNC, 0.0, "cpu:0"), deps=[("K1", DepKind.SYNC)])
    graph.append(Task.cpu("B", 10.0, op="aten.mm"))
    graph.append(Task.gpu("K2", 50.0, op="aten.mm"), deps=["B"])
    timeline = simulate(graph)
    assert timeline.makespan_us == pytest.approx(170.0)
    assert iteration_us(get_device("h100"), graph, timeline) == pytest.approx(160.0)
    two = repeated(graph, 2)
    assert len(two) == 2 * len(graph) and simulate(two).end("1|K2") == pytest.approx(330.0)


def test_the_ab_table_names_rows_whose_runners_page_faulted_many_times_a_call():
    quiet, faulting = Measurement(1.0, 1.0, 1.0, 5, 10, 0.0), Measurement(2.0, 2.0, 2.0, 5, 10, 16384.0)
    row = lambda eager: ABRow("m", 8, False, ("p",), eager, quiet, quiet, 1.0, 1.0, 0.0, ())  # noqa: E731
    assert "Page faults per call" not in ABResult("cpu", "2.x", "today", (row(quiet),)).to_markdown()
    text = ABResult("cpu", "2.x", "today", (row(faulting),)).to_markdown()
    assert text.endswith("Page faults per call (fresh memory from the allocator; `fxdream.keep_freed_memory()`): "
                         "m bs8 eager 16,384, baseline 0, optimized 0.")
