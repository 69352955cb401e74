import math
import statistics

import pytest
import torch
import torch.nn as nn

import fxdream
from fxdream.pass_api import PassContext, PassResult
from fxdream.plan import plan
from conftest import ConvBnNet
from fxdream.sim.prediction import predict
from fxdream.build import cost_model_for
from fxdream.simulation import simulate
from fxdream.sim.cost.analytic import Analytic
from fxdream.sim.cost.profiled import Profiled
from fxdream.ir.nodes import is_view
from fxdream.sim.profile import in_context
from fxdream.sim.profile.op_keys import profile_key


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_simulate_on_this_cpu_and_on_a_gpu_spec():
    model, x = Small(), torch.randn(2, 3, 8, 8)
    here = simulate(model, (x,), device="cpu", training=True)
    assert here.time_ms > 0 and here.peak_memory_bytes >= here.static_bytes > 0
    assert {t.phase for t in here.task_graph.tasks} >= {"fw", "bw", "optim"}
    assert "conv" in dict(here.top_layers(10))
    h100 = simulate(model, (x,), device="h100", training=False)
    assert isinstance(h100, fxdream.Prediction)
    assert any(t.resource == "stream:0" for t in h100.task_graph.tasks)
    assert "predicted inference on h100" in h100.summary()


def test_profiled_costs_are_measured_in_context_for_every_compute_node():
    model, x = Small(), torch.randn(2, 3, 8, 8)
    captured = fxdream.capture(model, (x,), training=True)
    cost = cost_model_for("cpu", "profiled")
    assert isinstance(cost, Profiled)
    predict(captured, cost, training=True)
    for _, gm in captured.graphs():
        for node in gm.graph.nodes:
            if node.op == "call_function" and not is_view(node):
                assert profile_key(node, "cpu") in cost.measurements, node.format_node()



def test_profiling_again_adds_samples_and_the_cost_is_their_median(monkeypatch):
    # no early stop of agreeing or long rounds: on a loaded machine this small graph's rounds can take that long
    monkeypatch.setattr(in_context, "AGREED_ROUNDS_S", math.inf)
    monkeypatch.setattr(in_context, "LONG_ROUNDS_S", math.inf)
    model, x = Small(), torch.randn(2, 3, 8, 8)
    captured = fxdream.capture(model, (x,), training=True)
    cost = cost_model_for("cpu", "profiled")
    cost.profile_in_context(captured, rounds=2, warmup=0)
    counts = {k: len(v) for k, v in cost.samples.items()}
    cost.profile_in_context(captured, rounds=2, warmup=0)  # profiled already: nothing new
    assert {k: len(v) for k, v in cost.samples.items()} == counts
    cost.profile_in_context(captured, rounds=3, warmup=0, again=True)
    for key, times in cost.samples.items():
        assert len(times) == counts[key] * 4  # of 2 runs the faster only, then 3 runs, of every graph
        assert cost.measurements[key] == statistics.median(times)
    assert cost.in_context == set(cost.samples)


def test_graphs_a_pipeline_timed_already_are_not_profiled_again():
    model, x = Small().eval(), torch.randn(2, 3, 8, 8)
    captured = fxdream.capture(model, (x,))
    cost = cost_model_for("cpu", "profiled")
    cost.profile_graph(captured.forward, captured.example_inputs, rounds=2, warmup=0)  # as the pipeline does
    counts = {k: len(v) for k, v in cost.samples.items()}
    predict(captured, cost, training=False)  # profiles in context unless it has every node already
    assert {k: len(v) for k, v in cost.samples.items()} == counts

def test_profiling_a_graph_stops_after_its_time_budget_but_not_before_three_rounds():
    from fxdream.sim.profile.in_context import MIN_ROUNDS
    model, x = Small().eval(), torch.randn(2, 3, 8, 8)
    captured = fxdream.capture(model, (x,))
    counts = {}
    for budget in (0.0, float("inf")):
        cost = cost_model_for("cpu", "profiled")
        cost.profile_graph(captured.forward, captured.example_inputs, rounds=6, warmup=1, budget_s=budget)
        counts[budget] = {len(v) for v in cost.samples.values()}
    assert counts == {0.0: {MIN_ROUNDS}, float("inf"): {6}}


_RUNS: list[float] = []


def _slow_relu(x):
    """~20 ms, 80 ms on its first call (a cold first round)."""
    import time
    time.sleep(0.08 if not _RUNS else 0.02)
    _RUNS.append(time.perf_counter())
    return torch.relu(x)


def _time_slow_graph(samples: dict, **kwargs) -> int:
    """Runs of a one-op graph ``time_graph`` made (its samples land in ``samples``)."""
    import torch.fx as fx
    import fxdream.sim.profile.in_context as in_context
    graph = fx.Graph()
    graph.output(graph.call_function(_slow_relu, (graph.placeholder("x"),)))
    _RUNS.clear()
    in_context.time_graph(fx.GraphModule(torch.nn.Module(), graph), [torch.randn(4)], torch.device("cpu"),
                          samples, warmup=0, **kwargs)
    return len(_RUNS)


def test_a_long_graph_is_timed_twice_not_three_times_and_keeps_the_warm_run(monkeypatch):
    import fxdream.sim.profile.in_context as in_context
    monkeypatch.setattr(in_context, "LONG_ROUNDS_S", 0.05)  # two rounds (~100 ms): "long"
    samples = {}
    assert _time_slow_graph(samples, rounds=6) == 2
    (times,) = samples.values()
    assert len(times) == 1 and times[0] < 50e3  # the faster: the second, not the cold first (~80 ms)
    monkeypatch.setattr(in_context, "LONG_ROUNDS_S", float("inf"))
    assert _time_slow_graph({}, rounds=6) == 6


def test_a_first_look_at_a_long_graph_is_one_round_and_every_round_ignores_it(monkeypatch):
    import fxdream.sim.profile.in_context as in_context
    monkeypatch.setattr(in_context, "LONG_ROUNDS_S", float("inf"))
    samples = {}
    assert _time_slow_graph(samples, rounds=6, one_round_above_s=0.05) == 1  # the first round took ~80 ms
    assert len(next(iter(samples.values()))) == 1
    assert _time_slow_graph({}, rounds=6, one_round_above_s=1.0) == 6  # a shorter first round: all six
    assert _time_slow_graph({}, rounds=3, one_round_above_s=0.05, every_round=True) == 3


def test_a_first_look_that_reads_slower_than_the_best_so_far_takes_more_rounds(monkeypatch):
    import fxdream.sim.profile.in_context as in_context
    monkeypatch.setattr(in_context, "LONG_ROUNDS_S", float("inf"))
    samples = {}  # the cold first round (~80 ms) is over the best so far (50 ms): not decisive alone
    assert _time_slow_graph(samples, rounds=3, one_round_above_s=0.05, one_round_under_us=50e3) == 3
    (times,) = samples.values()
    assert len(times) == 3 and sorted(times)[1] < 50e3  # the median is a warm round's (~20 ms)
    assert _time_slow_graph({}, rounds=3, one_round_above_s=0.05, one_round_under_us=100e3) == 1


def test_auto_takes_a_first_look_of_one_round_where_side_by_side_rounds_follow():
    from fxdream.pass_runner import FIRST_LOOK_ONE_ROUND_S, PassPipeline
    assert PassPipeline((), PassContext(), auto=True)._first_look_s() == FIRST_LOOK_ONE_ROUND_S
    assert PassPipeline((), PassContext(), auto=False)._first_look_s() == float("inf")


def test_a_graph_slower_than_a_bound_in_its_first_two_rounds_is_timed_twice():
    samples = {}
    assert _time_slow_graph(samples, rounds=4, give_up_above_us=5e3) == 2  # a round: ≥ 20 ms
    (times,) = samples.values()
    assert len(times) == 1 and times[0] < 50e3  # the faster of the two: the first was cold
    assert _time_slow_graph({}, rounds=4, give_up_above_us=55e3) == 4  # only the cold one over it
    assert _time_slow_graph({}, rounds=4, give_up_above_us=1e9) == 4


def test_a_pass_candidate_is_timed_against_the_best_prediction_before_it(monkeypatch):
    import fxdream.pass_runner as pipeline_module
    model, x = Small().eval(), torch.randn(2, 3, 8, 8)
    captured = fxdream.capture(model, (x,))
    rounds = []

    def recording(self, gm, inputs, **kwargs):
        rounds.append(kwargs.get("give_up_above_us"))
    monkeypatch.setattr(Profiled, "profile_graph", recording)
    monkeypatch.setattr(Profiled, "to_time_in_context", lambda self, gm: True)
    cost = cost_model_for("cpu", "profiled")
    pipeline = pipeline_module.PassPipeline((), PassContext(device="cpu", cost_model=cost))
    pipeline._inputs[(0, "fw")] = list(captured.example_inputs)
    monkeypatch.setattr(pipeline, "predict", lambda gm, phase: (gm.meta["us"], 0))
    seen = {}

    class ThreeCandidates:  # a pass that costs its candidates as fuse_conv_bias_act does
        name = "three_candidates"

        def applies_to(self, ctx):
            return None

        def __call__(self, gm, ctx):
            for us in (100.0, 80.0, 200.0):
                candidate = pipeline_module.copy_graph_module(gm)
                candidate.meta["us"] = us
                seen[us] = ctx.predict_us(candidate)
            return PassResult(gm, False, "compared only")
    pipeline.passes = (ThreeCandidates(),)
    pipeline(captured.forward, "fw", 0, {})
    factor = pipeline_module.GIVE_UP_SLOWER_THAN
    assert rounds == [float("inf"), factor * 100.0, factor * 80.0]  # bounded by the best before each
    assert seen == {100.0: 100.0, 80.0: 80.0, 200.0: 200.0}


def test_a_rewrites_profile_adds_only_its_new_ops():
    # a rewrite's run must not move the medians the prediction before it used
    from fxdream.ir.graphs import copy_graph_module
    model, x = Small().eval(), torch.randn(2, 3, 8, 8)
    captured = fxdream.capture(model, (x,))
    cost = cost_model_for("cpu", "profiled")
    cost.profile_graph(captured.forward, captured.example_inputs, rounds=3, warmup=0)
    before = {k: list(v) for k, v in cost.samples.items()}
    rewritten = copy_graph_module(captured.forward)
    relu = next(n for n in rewritten.graph.nodes if n.target is torch.ops.aten.relu.default)
    relu.target = torch.ops.aten.sigmoid.default  # one new op, the rest as before
    rewritten.recompile()
    cost.profile_graph(rewritten, captured.example_inputs, rounds=3, warmup=0, new_keys_only=True)
    assert {k: v for k, v in cost.samples.items() if k in before} == before
    assert [k for k in cost.samples if k not in before] == [profile_key(relu, "cpu")]


class Erf(torch.nn.Module):
    def forward(self, x):
        return torch.special.erf(x)


def test_new_ops_under_one_percent_of_the_graph_are_not_worth_timed_runs_of_it():
    from fxdream.ir.graphs import copy_graph_module
    from fxdream.sim.cost.profiled import FEW_NEW_OPS, MIN_SHARE
    model, x = Small().eval(), torch.randn(2, 3, 8, 8)
    captured = fxdream.capture(model, (x,))
    cost = cost_model_for("cpu", "profiled")
    base = captured.forward
    keys = [profile_key(n, "cpu") for n in base.graph.nodes if n.op == "call_function" and not is_view(n)]
    for key in keys:  # pretend every base op was timed in context at 100 µs
        cost.samples[key], cost.measurements[key] = [100.0], 100.0
    assert not cost.to_time_in_context(base)
    rewritten = copy_graph_module(base)
    relu = next(n for n in rewritten.graph.nodes if n.target is torch.ops.aten.relu.default)
    relu.target = torch.ops.aten.sigmoid.default
    rewritten.recompile()
    new_key, total_us = profile_key(relu, "cpu"), 100.0 * (len(keys) - 1)
    cost.measurements[new_key] = 0.9 * MIN_SHARE * total_us  # "timed alone": under the share
    assert not cost.to_time_in_context(rewritten)
    cost.measurements[new_key] = 2 * MIN_SHARE * total_us  # over it
    assert cost.to_time_in_context(rewritten)
    fresh = Profiled(cost.device)  # more new ops than FEW_NEW_OPS: timed in context, decided at once
    assert len(set(keys)) > FEW_NEW_OPS
    assert fresh.to_time_in_context(base) and not fresh.measurements
    # one op, new, the whole graph (as onednn_graph's compiled op): no micro-benchmark of it first
    whole = fxdream.capture(Erf().eval(), (x,)).forward
    before = dict(cost.measurements)
    assert cost.to_time_in_context(whole) and cost.measurements == before


def test_profile_round_trips_through_json(tmp_path):
    cost = cost_model_for("cpu", "profiled")
    model, x = Small(), torch.randn(2, 3, 8, 8)
    predict(fxdream.capture(model, (x,)), cost, training=False)
    cost.save(tmp_path / "profile.json")
    loaded = Profiled.load(tmp_path / "profile.json", cost.device)
    assert loaded.measurements == cost.measurements
    assert (tmp_path / "profile.json").read_text().startswith("{")  # JSON, never pickle


def test_simulate_with_passes_predicts_the_rewritten_graphs_for_a_gpu_from_this_cpu():
    model, x = Small().eval(), torch.randn(1, 3, 8, 8)
    plain = simulate(model, (x,), device="h100", cost="analytic")
    graphed = simulate(model, (x,), device="h100", cost="analytic", passes=["cuda_graphs"])
    (row,) = [r for r in graphed.passes if r.name == "cuda_graphs"]
    assert row.applied, row.reason  # rewritten for the h100 spec, never run here
    # one graph launch replaces the per-kernel launches of this launch-bound net
    assert graphed.time_ms < plain.time_ms
    assert any(t.op == "cuda_graph.launch" for t in graphed.task_graph.tasks)
    assert not plain.passes and "cuda_graphs [0/fw] applied" in graphed.summary()


def test_simulate_with_fusion_folds_batch_norm_and_counts_the_fused_convs_flops():
    model, x = Small().eval(), torch.randn(4, 3, 16, 16)
    plain = simulate(model, (x,), device="h100", cost="analytic")
    fused = simulate(model, (x,), device="h100", cost="analytic", passes=["fuse_conv_bias_act"])
    (row,) = [r for r in fused.passes if r.name == "fuse_conv_bias_act"]
    # the captured inputs are detached copies of the parameters: still known constants
    assert row.applied and "bn+relu" in row.reason, row.reason
    assert not any("not known constants" in note for note in row.notes), row.notes
    (conv,) = [n for n in plain.task_graph.tasks if n.op == "aten.convolution" and n.kind.name == "GPU"]
    (one,) = [n for n in fused.task_graph.tasks if n.op == "fxdream.conv_fused_inference" and n.kind.name == "GPU"]
    # the fused kernel does the convolution's FLOPs (once counted as 0: "free" convs)
    assert one.duration_us >= conv.duration_us
    assert fused.time_ms < plain.time_ms  # batch norm and relu kernels gone


@pytest.mark.parametrize("kwargs, message", [
    (dict(device="tpu9"), "unknown device 'tpu9'; valid names: cpu, v100, a100, h100, h200"),
    (dict(device="h100", cost="profiled"), "cost='profiled' measures on this machine"),
    (dict(cost="guess"), "cost='guess' is not a cost model; valid: 'profiled', 'analytic', 'auto'"),
    (dict(training=True, optimizer="lamb"), "optimizer='lamb' is not known; valid: sgd, sgd_plain, adam or None"),
])
def test_simulate_bad_arguments(kwargs, message):
    if kwargs.get("device") == "h100" and torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        simulate(Small(), (torch.randn(2, 3, 8, 8),), **kwargs)


def test_analytic_gpu_costs_are_roofline():
    captured = fxdream.capture(Small(), (torch.randn(2, 3, 8, 8),))
    cost = cost_model_for("h100", "analytic")
    assert isinstance(cost, Analytic)
    conv = next(n for n in captured.forward.graph.nodes if "convolution" in str(n.target))
    assert cost.kernel_us(conv) >= cost.device.kernel_min_us
    launch = cost.device.launch_overhead_us * cost.device.host_factor.get("conv", 1.0)  # cuDNN's host work
    assert cost.dispatch_us(conv) == pytest.approx(cost.device.dispatch_overhead_us + launch)


def test_symbolic_sizes_are_costed_and_materialized_at_their_traced_sizes():
    """dynamo's dynamic shapes give graphs whose sizes are SymInts: costs, profile keys and the
    stand-in tensors profiling builds use the sizes the graph was traced at."""
    from torch.fx.experimental.proxy_tensor import make_fx
    from fxdream.ir.tensors import tensor_bytes
    from fxdream.sim.profile.in_context import ones_like
    gm = make_fx(lambda x: torch.relu(x) * torch.ones(x.shape[0], 1), tracing_mode="symbolic")(torch.randn(3, 4))
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert any(isinstance(n.meta["val"].shape[0], torch.SymInt) for n in nodes)
    cost = cost_model_for("cpu", "profiled")
    for n in nodes:
        assert cost.kernel_us(n) >= 0
        assert "s0" not in profile_key(n, "cpu") and "SymInt" not in profile_key(n, "cpu")
    relu = next(n for n in nodes if "relu" in str(n.target))
    assert "(3, 4)" in profile_key(relu, "cpu")
    assert ones_like(relu.meta["val"], torch.device("cpu")).shape == (3, 4)
    assert tensor_bytes(relu.meta["val"]) == 3 * 4 * 4


_CALLS = [0]


def _third_call_slow(x):
    """Sleeps 1 ms, but 7 ms on every third call: three instances in one graph, one op and shape."""
    import time
    _CALLS[0] += 1
    time.sleep(0.007 if _CALLS[0] % 3 == 0 else 0.001)
    return x


def test_a_keys_cost_is_the_mean_of_its_instances_in_the_graph():
    # instances of one op and shape can cost differently in context (a MobileNet-like net: one
    # of three convs of one shape ~480 µs slower, run after run); the pooled median was the
    # fast instances' cost, and the graph was predicted faster than it ran
    import torch.fx as fx
    graph = fx.Graph()
    y = graph.placeholder("x")
    for _ in range(3):
        y = graph.call_function(_third_call_slow, (y,))
    graph.output(y)
    gm = fx.GraphModule(nn.Module(), graph)
    x = torch.zeros(2)
    for node in gm.graph.nodes:
        node.meta["val"] = x
    _CALLS[0] = 0
    cost = cost_model_for("cpu", "profiled")
    cost.profile_graph(gm, (x,), rounds=3, warmup=0)
    (key,) = cost.samples
    assert len(cost.samples[key]) == 3  # one sample per round: (1 + 1 + 7) / 3 ms
    assert 2500 < cost.measurements[key] < 5000  # the pooled median would be ~1000 µs


def test_ops_are_timed_by_clock_reads_in_a_copy_of_the_generated_code():
    # an fx.Interpreter between ops made small ops look slower than in the graph (MNIST bs1:
    # 462 µs summed vs 258 µs a run); the copy gives the same outputs and times every compute op
    import gc
    import weakref
    from fxdream.sim.profile.in_context import _STAMPS, compute_keys, timed_copy
    model, x = Small().eval(), torch.randn(2, 3, 8, 8)
    captured = fxdream.capture(model, (x,))
    gm = captured.forward
    timed, keys = timed_copy(gm, "cpu")
    compute = [n for n in gm.graph.nodes if n.op == "call_function" and not is_view(n)]
    assert keys == [profile_key(n, "cpu") for n in compute] == compute_keys(gm, "cpu")
    _STAMPS.clear()
    torch.testing.assert_close(timed(*captured.example_inputs), gm(*captured.example_inputs))
    assert [i for i, _ in _STAMPS] == list(range(len(compute)))
    _STAMPS.clear()
    assert timed_copy(gm, "cpu")[0] is timed  # cached per graph
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    relu.target = torch.ops.aten.sigmoid.default
    gm.recompile()
    retimed, rekeys = timed_copy(gm, "cpu")  # a changed graph gets a new copy
    assert retimed is not timed and any(k.startswith("aten.sigmoid") for k in rekeys)
    assert compute_keys(gm, "cpu") == rekeys  # the cached keys follow the code too
    # the caches do not keep a graph alive
    alive = weakref.ref(gm)
    del captured, gm, relu, compute
    gc.collect()
    assert alive() is None


def test_host_overheads_are_measured_before_the_capture_not_inside_it(monkeypatch):
    """Inside aot_autograd's compiler callback a compiled graph's call cost read ~4x too high."""
    from fxdream import pass_runner as pass_pipeline
    from fxdream.sim.cost import profiled as cost_module
    from fxdream.sim.profile import store as profile_store
    monkeypatch.setattr(profile_store, "_STORES", {})  # a store that has measured nothing yet
    events = []
    measure = cost_module.measure_graph_call_us
    monkeypatch.setattr(cost_module, "measure_graph_call_us",
                        lambda device, build: events.append("graph call measured") or measure(device, build))
    transform = pass_pipeline.PassPipeline.__call__
    monkeypatch.setattr(pass_pipeline.PassPipeline, "__call__",
                        lambda self, *a, **k: events.append("capture") or transform(self, *a, **k))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU()).eval()
    fxdream.optimize(model, (torch.randn(1, 3, 8, 8),), passes=["fuse_conv_bias_act"], cost="profiled")
    assert events[:2] == ["graph call measured", "capture"]


def test_ops_are_timed_without_the_python_dispatcher_aot_turns_on(monkeypatch):
    # a training capture (dynamo: aot has a shape env) runs its compiler callbacks under the
    # Python dispatcher; timed there, every op paid a trip through Python (a GRU: 5x)
    import fxdream.sim.cost.profiled as cost_module
    key, seen, time_graph = torch._C.DispatchKey.PythonDispatcher, [], cost_module.time_graph

    def recording(*args, **kwargs):
        seen.append(torch._C._dispatch_tls_is_dispatch_key_included(key))
        return time_graph(*args, **kwargs)
    monkeypatch.setattr(cost_module, "time_graph", recording)
    model, x = Small(), torch.randn(2, 3, 8, 8)
    fxdream.optimize(model, (x,), passes="auto", training=True)
    assert seen and not any(seen)


def test_timed_runs_copy_only_the_inputs_the_graph_writes():
    # cloning every buffer (ResNet-50: 106 BN statistics) cost 20 ms per timed graph; the copy
    # must still cover a write through a view, and anything the check cannot see into
    import torch.fx as fx
    from fxdream.sim.profile.in_context import owned_copies
    from fxdream.ir.aliasing import written_inputs
    aten = torch.ops.aten

    def graph_of(build):
        graph = fx.Graph()
        a, b, c = (graph.placeholder(n) for n in "abc")
        graph.output(build(graph, a, b, c))
        return fx.GraphModule(nn.Module(), graph)

    functional = graph_of(lambda g, a, b, c: g.call_function(aten.add.Tensor, (a, b)))
    through_view = graph_of(lambda g, a, b, c: g.call_function(
        aten.add_.Tensor, (g.call_function(aten.view.default, (b, [-1])), c)))
    out_arg = graph_of(lambda g, a, b, c: g.call_function(aten.add.out, (a, b), {"out": c}))
    python = graph_of(lambda g, a, b, c: g.call_function(torch.add, (a, b)))
    assert written_inputs(functional) == frozenset()
    assert written_inputs(through_view) == {1}
    assert written_inputs(out_arg) == {2}
    assert written_inputs(python) is None  # not an ATen op: cannot tell

    weight, buffers = nn.Parameter(torch.ones(2)), (torch.zeros(2), torch.zeros(2))
    inputs = (weight, *buffers)
    copies = owned_copies(inputs, through_view)
    assert copies[0] is weight and copies[2] is buffers[1] and copies[1] is not buffers[0]
    assert all(c is not b for c, b in zip(owned_copies(inputs, python)[1:], buffers))
    through_view(*copies)
    assert torch.equal(buffers[0], torch.zeros(2))  # the model's buffer is left alone


def _steady_relu(x):
    """~30 ms every call."""
    import time
    time.sleep(0.03)
    _RUNS.append(time.perf_counter())
    return torch.relu(x)


def test_two_rounds_that_agree_end_the_timing_of_a_graph_that_is_not_short(monkeypatch):
    # a third round cannot move the median of three further than the first two differ; ResNet-50
    # bs1's unfused graph ran 34.8 and 34.3 ms, and its third run cost ~70 ms of the build
    import torch.fx as fx
    import fxdream.sim.profile.in_context as in_context
    graph = fx.Graph()
    graph.output(graph.call_function(_steady_relu, (graph.placeholder("x"),)))
    gm = fx.GraphModule(torch.nn.Module(), graph)

    def runs(**kwargs):
        _RUNS.clear()
        in_context.time_graph(gm, [torch.randn(4)], torch.device("cpu"), {}, rounds=4, warmup=0, **kwargs)
        return len(_RUNS)
    monkeypatch.setattr(in_context, "AGREED", 0.5)  # sleeps agree within 50 % on any machine
    assert runs() == 2
    monkeypatch.setattr(in_context, "AGREED_ROUNDS_S", 1.0)  # two 30 ms rounds: short, timed four times
    assert runs() == 4
    monkeypatch.setattr(in_context, "AGREED_ROUNDS_S", 0.05)
    monkeypatch.setattr(in_context, "AGREED", 0.0)  # never agree exactly: four rounds
    assert runs() == 4


def test_the_pipeline_predicts_a_copy_of_a_graph_from_the_first_prediction(monkeypatch):
    # a pass keeping a copy of its input to compare against asks for a graph predicted already
    import fxdream.pass_runner as pipeline_module
    calls = []
    real = pipeline_module.graph_prediction
    monkeypatch.setattr(pipeline_module, "graph_prediction", lambda *a: calls.append(a) or real(*a))
    captured = fxdream.capture(Small().eval(), (torch.randn(2, 3, 8, 8),))
    analytic = cost_model_for("cpu", "analytic")
    pipeline = pipeline_module.PassPipeline((), PassContext(device="cpu", cost_model=analytic))
    gm = captured.forward
    first = pipeline.predict(gm, "fw")
    assert pipeline.predict(pipeline_module.copy_graph_module(gm), "fw") == first and len(calls) == 1
    changed = pipeline_module.copy_graph_module(gm)
    relu = next(n for n in changed.graph.nodes if n.target is torch.ops.aten.relu.default)
    with changed.graph.inserting_after(relu):
        doubled = changed.graph.call_function(torch.ops.aten.mul.Tensor, (relu, 2.0))
    doubled.meta.update(relu.meta)
    relu.replace_all_uses_with(doubled, delete_user_cb=lambda user: user is not doubled)
    assert pipeline.predict(changed, "fw") != first and len(calls) == 2  # other nodes: simulated


def test_the_summarys_ms_column_lines_up_under_long_layer_names():
    model = nn.Sequential()
    model.add_module("a_layer_name_longer_than_the_forty_characters_the_column_had", nn.Linear(8, 8))
    model.add_module("short", nn.Linear(8, 8))
    lines = fxdream.simulate(model, (torch.randn(2, 8),), device="h100").summary().splitlines()
    rows = [line for line in lines if line.endswith("%") and " ms " in line]
    assert len(rows) == 2 and len({line.index(" ms ") for line in rows}) == 1


def test_the_pipeline_predicts_a_graph_again_once_a_cost_it_used_changed():
    # a candidate's new ops timed in context after another candidate used their alone timings:
    # a pass's row (before and after) and the plan's totals must see the same costs
    import fxdream.pass_runner as pipeline_module
    captured = fxdream.capture(Small().eval(), (torch.randn(2, 3, 8, 8),))
    gm = captured.forward
    cost = Profiled(cost_model_for("cpu", "analytic").device)
    cost.measurements.update({profile_key(n, "cpu"): 1e6 for n in gm.graph.nodes
                              if n.op == "call_function" and not is_view(n)})
    pipeline = pipeline_module.PassPipeline((), PassContext(device="cpu", cost_model=cost))
    stale = pipeline.predict(gm, "fw")[0]
    cost.profile_graph(gm, list(captured.example_inputs))  # real times: far under 1 s an op
    assert cost.revision > 0
    assert pipeline.predict(gm, "fw") == pipeline_module.graph_prediction(gm, cost, "fw")
    assert pipeline.predict(gm, "fw")[0] < stale / 100


def test_plan_runs_the_passes_again_until_the_costs_they_chose_on_settle(monkeypatch):
    # a run on in-context costs may choose another variant, whose ops are timed in context then
    import fxdream.plan as plan_module
    model, x = ConvBnNet().eval(), torch.randn(2, 3, 16, 16)
    captured = fxdream.capture(model, (x,))
    runs, changes = [], iter([True, True, False])
    real_run = plan_module._passes_run
    monkeypatch.setattr(plan_module, "_passes_run", lambda *a: runs.append(1) or real_run(*a))

    def timed_in_context(self, captured, graphs=None, **kwargs):
        if graphs is not None and next(changes, False):
            self.revision += 1  # a cost the run before used changed
    monkeypatch.setattr(Profiled, "profile_in_context", timed_in_context)
    plan(model, captured, device="cpu", passes=["fuse_conv_bias_act"], cost="profiled")
    assert len(runs) == 3  # the first, then one per change


def test_measured_plan_rows_add_up_to_its_predicted_totals():
    """The rewrite's new ops are timed alone while the passes choose, then in context for the
    totals: the passes run again on those costs, so each row says what the totals say."""
    model, x = ConvBnNet().eval(), torch.randn(2, 3, 16, 16)
    captured = fxdream.capture(model, (x,))
    rng = torch.get_rng_state()
    planned = plan(model, captured, device="cpu", passes=["fuse_conv_bias_act"], cost="profiled")
    assert torch.equal(torch.get_rng_state(), rng)  # its ops were timed on random data, drawn from a fork
    (row,) = [r for r in planned.rows if r.applied]
    assert row.predicted_delta_us == pytest.approx((planned.after.time_ms - planned.before.time_ms) * 1e3)
