"""The graphs a build's decision compares are timed in the same interleaved rounds
(``Profiled.profile_side_by_side``): their costs come from those rounds alone."""
import pytest
import torch
from conftest import ConvBnNet, graph_with_values

import fxdream
import fxdream.sim.cost.side_by_side as side_by_side
from fxdream.sim.cost import Profiled, get_device
from fxdream.sim.cost.run_spread import RunSpread
from fxdream.sim.cost.side_by_side import COLD_RUN_FAULTS, TimedRun, warm_runs
from fxdream.sim.cost.spread import SpreadBound
from fxdream.sim.profile.op_keys import profile_key

aten = torch.ops.aten


def _graph(*ops):
    def build(graph, x):
        for op in ops:
            x = graph.call_function(op, (x,))
        return x
    return graph_with_values(build, (64, 64))


def test_rounds_interleave_the_graphs_and_replace_earlier_samples():
    relu_sigmoid, relu_tanh = _graph(aten.relu.default, aten.sigmoid.default), _graph(aten.relu.default,
                                                                                     aten.tanh.default)
    cost = Profiled(get_device("cpu"))
    keys = {op: profile_key(next(n for n in gm.graph.nodes if n.target is op), "cpu")
            for gm, op in ((relu_sigmoid, aten.relu.default), (relu_sigmoid, aten.sigmoid.default),
                           (relu_tanh, aten.tanh.default))}
    cost.samples[keys[aten.relu.default]] = [1e6]  # an earlier, far slower sample: dropped
    x = torch.randn(64, 64)
    assert cost.profile_side_by_side([(relu_sigmoid, [x]), (relu_tanh, [x])], rounds=3) == 3
    assert len(cost.samples[keys[aten.relu.default]]) == 6  # in both graphs, every round
    assert len(cost.samples[keys[aten.sigmoid.default]]) == len(cost.samples[keys[aten.tanh.default]]) == 3
    assert max(cost.samples[keys[aten.relu.default]]) < 1e6
    assert cost.measurements[keys[aten.relu.default]] < 1e6


def test_default_rounds_fit_the_budget_between_two_and_fifteen():
    gm = _graph(aten.relu.default)
    cost = Profiled(get_device("cpu"))
    key = profile_key(next(n for n in gm.graph.nodes if n.op == "call_function"), "cpu")
    cost.measurements[key] = 1.0  # µs: any number fits; fifteen at most
    assert cost._rounds_in_budget([(gm, None)]) == 15
    cost.measurements[key] = 50_000.0  # 50 ms a run: six in 0.3 s
    assert cost._rounds_in_budget([(gm, None)]) == 6
    cost.measurements[key] = 1e6  # a second per run: still two (a median needs them)
    assert cost._rounds_in_budget([(gm, None)]) == 2
    assert Profiled(get_device("cpu"), context_rounds=4).context_rounds == 4


def test_an_auto_build_times_the_captured_graph_beside_its_candidates_and_a_rebuild_does_not(monkeypatch):
    calls = []
    original = Profiled.profile_side_by_side

    def recording(self, graphs, rounds=None):
        calls.append([gm for gm, _ in graphs])
        return original(self, graphs, rounds)
    monkeypatch.setattr(Profiled, "profile_side_by_side", recording)
    model, x = ConvBnNet().eval(), torch.randn(2, 3, 16, 16)
    first = fxdream.optimize(model, (x,), passes="auto", cost="profiled")
    (graphs,) = calls
    assert graphs[0] is first.captured[0].forward  # with the candidates that can win (none may)
    calls.clear()
    fxdream.optimize(model, (x,), passes="auto", cost="profiled")
    assert calls == []


def test_side_by_side_rounds_give_each_graph_its_whole_runs_spread():
    gm = _graph(aten.relu.default, aten.sigmoid.default)
    cost = Profiled(get_device("cpu"))
    cost.profile_side_by_side([(gm, [torch.randn(64, 64)]), (_graph(aten.tanh.default), [torch.randn(64, 64)])],
                              rounds=4)
    spread = cost.run_spread_of(gm)
    assert spread.keys == frozenset(cost.keys_of(gm)) and spread.low <= 1.0 <= spread.high


def test_a_range_scales_a_graph_timed_side_by_side_by_its_runs_spread_not_each_ops_extremes():
    gm = _graph(aten.relu.default, aten.sigmoid.default)
    relu, sigmoid = [n for n in gm.graph.nodes if n.op == "call_function"]
    cost = Profiled(get_device("cpu"))
    for node, samples in ((relu, [1.0, 2.0, 9.0]), (sigmoid, [10.0, 20.0, 90.0])):
        cost.samples[profile_key(node, "cpu")] = samples
        cost.measurements[profile_key(node, "cpu")] = samples[1]
    low, high = SpreadBound(cost, "low"), SpreadBound(cost, "high")
    assert (high.kernel_us(relu), high.kernel_us(sigmoid)) == (9.0, 90.0)  # not timed side by side
    cost.run_spreads.append(RunSpread(frozenset(cost.keys_of(gm)), 0.9, 1.25))
    low, high = SpreadBound(cost, "low"), SpreadBound(cost, "high")
    assert low.kernel_us(relu) == pytest.approx(1.8) and high.kernel_us(sigmoid) == pytest.approx(25.0)
    other = _graph(aten.tanh.default)  # none of its cost in the timed graph: its own samples
    assert cost.run_spread_of(other) is None


def test_warm_runs_leave_out_runs_that_faulted_unless_every_run_did():
    def run(faults):
        return TimedRun({}, 1.0, faults)
    cold, warm = run(12_544), run(0)
    assert warm_runs([cold, warm, run(COLD_RUN_FAULTS - 1)]) == [warm, run(COLD_RUN_FAULTS - 1)]
    assert warm_runs([run(64_352), run(56_352)]) == [run(64_352), run(56_352)]  # faults in every run: kept
    assert warm_runs([cold, run(None)]) == [run(None)]  # not counted: taken as warm


def _counted_faults(monkeypatch, faults_per_run):
    """page_faults() read before and after each timed run: each run takes the next count given."""
    readings, total = [], 0
    for faults in faults_per_run:
        readings += [total, total + faults]
        total += faults
    counter = iter(readings)
    monkeypatch.setattr(side_by_side, "page_faults", lambda: next(counter))


def _long_graphs_timed_side_by_side(rounds):
    gm, other = _graph(aten.relu.default, aten.sigmoid.default), _graph(aten.tanh.default)
    cost = Profiled(get_device("cpu"))
    for key in cost.keys_of(gm) + cost.keys_of(other):
        cost.measurements[key] = 1e5  # long graphs: no untimed run before each, one count per run
    x = torch.randn(64, 64)
    assert cost.profile_side_by_side([(gm, [x]), (other, [x])], rounds=rounds) == rounds
    return cost, gm, other


def test_a_graph_that_faulted_after_another_is_timed_again_back_to_back(monkeypatch):
    # rounds: gm, other | other, gm; then gm back to back twice (after an untimed run)
    _counted_faults(monkeypatch, [50_000, 0, 0, 40_000, 0, 0])
    cost, gm, other = _long_graphs_timed_side_by_side(rounds=2)
    relu = cost.keys_of(gm)[0]
    assert len(cost.samples[relu]) == 2  # the two back-to-back runs' samples only
    assert cost.run_spread_of(gm).page_faults_per_run == 0
    assert len(cost.samples[cost.keys_of(other)[0]]) == 2


def test_a_graph_that_faults_back_to_back_too_keeps_its_runs(monkeypatch):
    _counted_faults(monkeypatch, [50_000, 0, 0, 40_000, 45_000])
    cost, gm, _ = _long_graphs_timed_side_by_side(rounds=2)
    assert len(cost.samples[cost.keys_of(gm)[0]]) == 3
    assert cost.run_spread_of(gm).page_faults_per_run == 45_000
