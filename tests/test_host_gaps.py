"""Host time outside the captured graphs: measured per gap, lowered as host tasks."""
import dataclasses
import time

import pytest
import torch
import torch.nn as nn
from conftest import graph_with_values
from test_sim_lower import CPU, GPU, FixedCost, _relu_view_add

import fxdream
from fxdream.build import cost_model_for
from fxdream.capturing import host_gaps
from fxdream.capturing.capture_model import capture_with_host_gaps
from fxdream.capturing.host_gaps import END, StepCalls, SubgraphClock, measure_host_gaps, step_calls
from fxdream.sim.lower import lower
from fxdream.sim.optimizer_step import SGD
from fxdream.sim.prediction import predict
from fxdream.sim.simulate import simulate

# SlowEagerBetween sleeps in forward on purpose: dynamo runs that builtin eagerly and says so
pytestmark = pytest.mark.filterwarnings("ignore:Dynamo does not know how to trace the builtin")


def test_a_step_is_its_calls_in_order_with_the_host_time_around_them():
    events = [("g1.fw", 3.0e-6, 4.0e-6), ("g0.fw", 1.0e-6, 2.0e-6), ("g0.fw", 5.0e-6, 7.0e-6)]  # any order
    step = step_calls(events, started=0.0, ended=10.0e-6)
    assert step.calls == ("g0.fw", "g1.fw", "g0.fw")
    assert step.gaps_us == pytest.approx((1.0, 1.0, 1.0)) and step.end_us == pytest.approx(3.0)
    assert step.total_us == pytest.approx(6.0) and step.counts() == {"g0.fw": 2, "g1.fw": 1}


def test_the_median_step_keeps_the_most_frequent_sequence():
    a = StepCalls(("g0.fw", "g1.fw"), (1.0, 2.0), 3.0)
    b = StepCalls(("g0.fw", "g1.fw"), (3.0, 4.0), 5.0)
    other = StepCalls(("g0.fw", "g2.fw"), (100.0, 100.0), 100.0)  # the other branch, once
    median = StepCalls.median([a, other, b])
    assert median == StepCalls(("g0.fw", "g1.fw"), (2.0, 3.0), 4.0, steps_us=(6.0, 12.0))  # each sample's total


def test_clock_records_only_while_measuring_and_keeps_the_boxed_convention():
    clock = SubgraphClock()
    call = clock.wrap(lambda args: [a * 2 for a in args], "g0.fw")
    assert call._boxed_call and call([1, 2]) == [2, 4] and clock.events is None

    def step():
        time.sleep(0.002)
        call([1])
    measured = measure_host_gaps(step, clock, rounds=2, warmup=0)
    assert measured.calls == ("g0.fw",) and measured.gaps_us[0] >= 2000 and clock.events is None


def test_repeated_calls_are_lowered_once_each_and_backwards_pair_last_in_first_out():
    from fxdream.sim.call_order import as_called
    fw, bw = object(), object()
    step = StepCalls(("g0.fw", "g0.fw", "g0.bw", "g0.bw", "g9.fw"), (1.0, 2.0, 3.0, 4.0, 5.0), 6.0)
    ordered, gaps, _, _ = as_called({"g0.fw": fw, "g0.bw": bw}, step)
    assert ordered == [("g0.fw", fw), ("g0#1.fw", fw), ("g0#1.bw", bw), ("g0.bw", bw)]
    # a call of a graph not captured here (g9) adds its gap to the end
    assert gaps == {"g0.fw": 1.0, "g0#1.fw": 2.0, "g0#1.bw": 3.0, "g0.bw": 4.0, END: 11.0}
    named = dataclasses.replace(step, gap_layers=((("a", 0.5),), (), (), (), (("b", 0.2),), (("c", 0.5),)))
    *_, modules = as_called({"g0.fw": fw, "g0.bw": bw}, named)
    assert modules == {"g0.fw": (("a", 0.5),), END: (("c", 3.0), ("b", 1.0))}  # µs: g9's gap joins the end's


def test_gaps_lower_to_host_tasks_before_their_graph_and_at_the_end():
    fw = graph_with_values(_relu_view_add, (4,))
    graphs = [("g0.fw", fw), ("g1.fw", fw)]
    lowered = lower(graphs, FixedCost(CPU), host_gaps={"g1.fw": 5.0, END: 7.0})
    names = [t.name for t in lowered.graph.tasks]
    assert names.index("host_gap:g1.fw") == names.index("g1.fw:relu") - 1
    assert names[-1] == f"host_gap:{END}"
    # two graphs of relu 1+10, view 1, add 1+10 (23 µs each) plus the gaps, all on one thread
    assert simulate(lowered.graph).makespan_us == pytest.approx(2 * 23.0 + 5.0 + 7.0)


def test_a_named_gap_is_split_among_its_modules_and_the_rest_keeps_its_time():
    fw = graph_with_values(_relu_view_add, (4,))
    lowered = lower([("g0.fw", fw)], FixedCost(CPU), host_gaps={"g0.fw": 100.0},
                    gap_layers={"g0.fw": (("head", 25.0), ("tail", 50.0))})
    gap = [(t.name, t.layer, t.duration_us) for t in lowered.graph.tasks if t.op == "host_gap"]
    assert gap == [("host_gap:g0.fw:0", "head", 25.0), ("host_gap:g0.fw:1", "tail", 50.0), ("host_gap:g0.fw", "", 25.0)]
    assert simulate(lowered.graph).makespan_us == pytest.approx(23.0 + 100.0)


def test_on_a_gpu_a_host_gap_overlaps_the_kernels_already_launched():
    fw = graph_with_values(_relu_view_add, (4,))
    lowered = lower([("g0.fw", fw)], FixedCost(GPU), host_gaps={END: 5.0})
    # cpu: relu [0,1] view [1,2] add [2,3] gap [3,8]; stream: relu [1,11] add [11,21]
    assert simulate(lowered.graph).makespan_us == pytest.approx(21.0)


class SlowEagerBetween(nn.Module):
    """20 ms of eager host work between two captured subgraphs."""
    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x):
        h = self.first(x)
        torch._dynamo.graph_break()
        time.sleep(0.02)
        return self.second(h)


def test_a_graph_break_costs_its_measured_eager_time_in_the_prediction():
    model, x = SlowEagerBetween(), torch.randn(3, 4)
    captured, step, notes = capture_with_host_gaps(model, (x,), training=True)
    assert len(captured) == 2 and "eager code around the 2 captured graphs, autograd" in notes[0]
    assert step.calls == ("g0.fw", "g1.fw", "g1.bw", "g0.bw") and step.gaps_us[1] >= 20000
    cost = cost_model_for("cpu", "profiled")
    without = predict(captured, cost, True).time_ms
    with_gaps = predict(captured, cost, True, step=step).time_ms
    assert without < 5 and with_gaps - without >= 19.5  # the 20 ms sleep is in the prediction
    prediction = fxdream.simulate(model, (x,), training=True)
    assert prediction.time_ms >= 20 and any("eager code around" in n for n in prediction.notes)
    assert "note: measured host time" in prediction.summary()


class SlowEagerFirst(nn.Module):
    """20 ms of eager host work (a graph break) before the one graph captured (by dynamo: a
    forward taking ``*args`` is not traced by torch.fx, which would run the sleep once, at trace time)."""
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 2)

    def forward(self, *inputs):
        time.sleep(0.02)
        return self.linear(inputs[0])


def test_an_inference_call_with_one_graph_after_eager_code_is_predicted_with_that_code():
    model, x = SlowEagerFirst().eval(), torch.randn(3, 4)
    prediction = fxdream.simulate(model, (x,))
    assert prediction.time_ms >= 20  # the eager 20 ms, measured as host time before the graph
    assert any("eager code around the captured graph)" in n for n in prediction.notes), prediction.notes
    assert any(t.op == "host_gap" for t in prediction.task_graph.tasks)


class PackedGru(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(6, 8)

    def forward(self, x, lengths):
        return self.rnn(nn.utils.rnn.pack_padded_sequence(x, lengths))[1]


def test_a_model_with_nothing_captured_is_predicted_as_its_eager_step():
    # dynamo runs an RNN over a packed sequence eagerly, in training on any device
    model, inputs = PackedGru().train(), (torch.randn(5, 2, 6), torch.tensor([5, 3]))
    prediction = fxdream.simulate(model, inputs, training=True)
    assert prediction.time_ms > 0 and not any(t.op == "graph_call" for t in prediction.task_graph.tasks)
    note = prediction.notes[0]  # (a busy machine adds a note after it)
    assert note.startswith("nothing was captured from PackedGru") and "the whole step ran as eager code" in note
    # for another device: the step's ATen ops, recorded and costed from their shapes (the GRU as one
    # op and its backward as another, as in a captured graph)
    elsewhere = fxdream.simulate(model, inputs, device="h100", training=True)
    ops = [t.op for t in elsewhere.task_graph.tasks if t.kind == "cpu"]
    assert ops.count("fxdream.rnn_train") == 1 and ops.count("fxdream.rnn_train_backward") == 1
    assert not any(t.op == "graph_call" for t in elsewhere.task_graph.tasks)
    assert any(n.startswith("nothing was captured from PackedGru") and n.endswith("predicted from its ATen ops")
               for n in elsewhere.notes), elsewhere.notes


def test_predictions_for_another_device_measure_no_gaps():
    model, x = SlowEagerBetween(), torch.randn(3, 4)
    prediction = fxdream.simulate(model, (x,), device="h100", training=True)
    assert prediction.time_ms < 20 and not any("measured host time" in n for n in prediction.notes)
    assert [n.split(" (")[0] for n in prediction.notes] == ["the eager code where the graph broke"]


def test_optimize_reports_the_gaps_of_a_training_step():
    model, x = SlowEagerBetween(), torch.randn(3, 4)
    optimized = fxdream.optimize(model, (x,), training=True, passes=["fuse_conv_bias_act"])
    report = optimized.report
    assert report.predicted_baseline_ms >= 20
    assert any("eager code around" in n for n in report.notes)
    assert all(p.grad is None for p in model.parameters())  # measuring left no gradients


def test_the_note_names_the_causes_and_graphs_run_twice():
    from fxdream.capturing.host_gaps import describe_gaps
    step = StepCalls(("g0.fw", "g0.fw", "g0.bw"), (1000.0, 500.0, 0.0), 500.0)
    one, twice = describe_gaps(step, 1, True)
    assert one == "measured host time outside the graphs (autograd): 2.000 ms per step, simulated as host tasks"
    assert twice == "graphs called more than once per step, simulated once per call: {'g0.fw': 2}"
    (only,) = describe_gaps(StepCalls(("g0.fw", "g1.fw"), (0.0, 0.0), 0.0), 2, False)
    assert "(eager code around the 2 captured graphs)" in only
    (broke,) = describe_gaps(StepCalls(("g0.fw",), (0.0,), 0.0), 1, True, graph_breaks=1)
    assert "(eager code around the captured graph, autograd)" in broke


class BreakingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        y = torch.relu(self.linear(x))
        torch._dynamo.graph_break()
        return y * 2


class RepeatedBreak(nn.Module):
    """One block class, three instances, a graph break in each: dynamo compiles the block's
    pieces once and calls those graphs three times per step."""
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(BreakingBlock() for _ in range(3))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


def test_a_graph_called_per_block_is_simulated_per_call():
    model, x = RepeatedBreak(), torch.randn(4, 8)
    captured, step, notes = capture_with_host_gaps(model, (x,), training=True)
    fw_calls = [c for c in step.calls if c.endswith(".fw")]
    assert len(fw_calls) > len(captured)  # some graph ran more than once
    assert "simulated once per call" in notes[1]
    prediction = predict(captured, cost_model_for("cpu", "profiled"), True, SGD, step=step)
    labels = {t.name.split(":")[0] for t in prediction.task_graph.tasks if ":" in t.name}
    assert len({lb for lb in labels if lb.endswith(".fw")}) == len(fw_calls)
    # every call's backward returns its own block's gradients: 3 weights + 3 biases updated
    assert len(prediction.task_graph.select(phase="optim")) == 6


def test_measuring_stops_when_the_budget_is_spent_and_keeps_a_long_warm_up_step_spent_in_graphs():
    clock = SubgraphClock()
    call = clock.wrap(lambda args: time.sleep(0.03), "g0.fw")
    runs = []

    def slow_graph_step():
        runs.append(1)
        call([])
    measured = measure_host_gaps(slow_graph_step, clock, rounds=5, warmup=1, budget_s=0.01)
    assert len(runs) == 1 and measured.calls == ("g0.fw",)  # the warm-up step alone was over budget
    runs.clear()
    measured = measure_host_gaps(slow_graph_step, clock, rounds=2, warmup=1, budget_s=60.0)
    assert len(runs) == 3 and measured.calls == ("g0.fw",)  # within budget: warm-up + every round


def test_a_long_warm_up_step_spent_outside_the_graphs_is_not_the_sample(monkeypatch):
    """Eager code between graphs runs slower on a cold step: its gaps are taken from the next."""
    clock, fake = SubgraphClock(), _StepTime()
    monkeypatch.setattr(host_gaps, "time", fake)
    call = clock.wrap(lambda args: None, "g0.fw")
    gap_s = [2.0, 1.0, 1.0, 1.0]  # a cold step, then steady ones

    def eager_step():
        fake.now += gap_s.pop(0)
        call([])
    measured = measure_host_gaps(eager_step, clock, rounds=5, warmup=1, budget_s=0.5)
    assert measured.gaps_us[0] == pytest.approx(1e6)  # the steady step's gap, not the cold one's
    assert len(gap_s) == 2  # the warm-up and one sample: the budget was spent


class _StepTime:
    """perf_counter for ``measure_host_gaps``: it moves only where a step moves it."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class _BlockWithBreak(nn.Module):
    """Dynamo compiles its halves once and calls them once per block."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        x = torch.relu(self.first(x))
        torch._dynamo.graph_break()
        return torch.relu(self.second(x))


class _Blocks(nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.blocks = nn.ModuleList(_BlockWithBreak() for _ in range(n))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


@pytest.mark.parametrize("training", [False, True])
def test_a_prediction_for_another_device_costs_a_graph_once_per_call(training):
    torch.manual_seed(0)
    x = torch.randn(8, 32)
    one, four = (fxdream.simulate(_Blocks(n), (x,), device="h100", training=training) for n in (1, 4))
    assert four.time_ms > 3.5 * one.time_ms  # each half of each block, not each half once
    assert any("simulated once per call: {'g0.fw': 4, 'g1.fw': 4}" in n for n in four.notes) or training
    names = [t.name for t in four.task_graph.tasks]
    assert "g1#3.fw:call" in names and all(not n.startswith("host_gap:g") for n in names)  # nothing was timed
    if training:  # the engine is modelled per backward call, as where nothing is measured at all
        assert "g1#3.bw:autograd" in names
    # every block's parameters are inputs of a graph call: none counted again as state outside the graphs
    assert four.outside_state_bytes == 0


def test_an_unmeasured_call_order_lowers_each_call_with_the_engine_modelled():
    from fxdream.sim.lower import lower_captured
    step = StepCalls(("g0.fw", "g0.fw", "g0.bw", "g0.bw"), (0.0,) * 4, 0.0, measured=False)
    captured = fxdream.capture(nn.Linear(4, 4), (torch.randn(2, 4),), training=True)
    names = [t.name for t in lower_captured(captured, cost_model_for("h100", "analytic"), step=step).graph.tasks]
    assert [n for n in names if n.endswith(":autograd")] == ["g0#1.bw:autograd", "g0.bw:autograd"]
    assert not any(n.startswith("host_gap") for n in names)


def test_short_steps_are_sampled_until_the_fill_time_is_spent(monkeypatch):
    clock, fake = SubgraphClock(), _StepTime()
    monkeypatch.setattr(host_gaps, "time", fake)
    call = clock.wrap(lambda args: None, "g0.fw")
    runs = []

    def step(seconds):
        runs.append(1)
        fake.now += seconds
        call([])
    measure_host_gaps(lambda: step(0.012), clock, rounds=3, warmup=1, fill_s=0.05)
    assert len(runs) == 1 + 4  # warm-up, then samples until 50 ms are spent in all (12 ms each)
    runs.clear()
    measure_host_gaps(lambda: step(0.0001), clock, rounds=3, warmup=1, fill_s=0.05)
    assert len(runs) == 1 + host_gaps.MAX_SAMPLES
    runs.clear()
    measure_host_gaps(lambda: step(0.0001), clock, rounds=3, warmup=1)
    assert len(runs) == 1 + 3  # no fill: the rounds asked for
