"""aux_stream_backward: the split is exact, the graph orders its streams, the simulator sees the
overlap (time with and without contention, memory) and the pass decides by it; the crossover
formula; real CUDA streams (cuda-marked)."""
import copy
import math
import operator

import pytest
import torch
import torch.fx as fx

import fxdream
from fxdream import models
from fxdream.runtime import streams
from fxdream.explain import b as B
from fxdream.explain import _Symbolic, crossover, crossover_of_graphs, formula, model_terms
from fxdream.pass_api import PassContext
from fxdream.pass_registry import available_passes
from fxdream.ir.graphs import copy_graph_module
from fxdream.passes import aux_stream_backward as aux
from fxdream.sim.cost import occupancy
from fxdream.sim.cost.analytic import Analytic
from fxdream.ir.nodes import is_view
from fxdream.sim.cost.devices import DeviceSpec
from fxdream.sim.lower import lower
from fxdream.sim.simulate import Contention, simulate

from conftest import RecordValues, assert_same_training_step

aten = torch.ops.aten
CONV_BW = aten.convolution_backward.default
PASS = "aux_stream_backward"
ZOO = ("resnet18", "resnet50", "vgg19", "densenet121", "mnist_convnet")
GPU = DeviceSpec("toy-gpu", "cuda", {"float32": 1e12}, 1e15, launch_overhead_us=0.0,
                 dispatch_overhead_us=1.0, kernel_min_us=0.0, num_sms=4, memory_bytes=2**30)


# --- helpers ----------------------------------------------------------------------------------------
def backward_inputs(captured):
    """Real inputs of the captured backward: the forward's saved tensors (by name), ones for tangents."""
    inputs = [x.clone() if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter) else x
              for x in captured.example_inputs]
    with torch.no_grad():
        outputs = captured.forward(*inputs)
    out_node = next(n for n in captured.forward.graph.nodes if n.op == "output")
    names = [a.name if isinstance(a, fx.Node) else None for a in torch.utils._pytree.tree_leaves(out_node.args)]
    values = dict(zip(names, torch.utils._pytree.tree_leaves(outputs)))
    return [values[n.name] if n.name in values else
            torch.ones(n.meta["val"].shape, dtype=n.meta["val"].dtype, device=n.meta["val"].device)
            for n in captured.backward.graph.nodes if n.op == "placeholder"]


def conv_backward_graph(layers=3, channels=8, pixels=4, batch=1):
    """conv_bw of ``layers`` chained 1x1 convs, last layer first (grad → dx3 → dx2 → ...);
    outputs the first layer's dx and every dw. Real tensors as meta["val"]."""
    graph = fx.Graph()
    g = graph.placeholder("g")
    xs = {k: graph.placeholder(f"x{k}") for k in range(layers, 0, -1)}
    ws = {k: graph.placeholder(f"w{k}") for k in range(layers, 0, -1)}
    grad, dws = g, {}
    for k in range(layers, 0, -1):
        cb = graph.create_node("call_function", CONV_BW, (grad, xs[k], ws[k], [0], [1, 1], [0, 0], [1, 1], False,
                                                          [0, 0], 1, [True, True, False]), name=f"cb{k}")
        cb.meta["layer"] = f"layer{k}"
        grad = graph.call_function(operator.getitem, (cb, 0))
        dws[k] = graph.call_function(operator.getitem, (cb, 1))
    graph.output((grad, *[dws[k] for k in range(1, layers + 1)]))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    act = (batch, channels, pixels, pixels)
    args = [torch.randn(act) for _ in range(layers + 1)] + [torch.randn(channels, channels, 1, 1) for _ in range(layers)]
    RecordValues(gm).run(*args)
    return gm, args


def three_layer_backward():
    return conv_backward_graph(3)


class ToyCost:
    """Host 1 µs per node; a convolution_backward costs d (dgrad) + w (wgrad) µs, each part
    filling ``u`` of the device; events 0 µs."""
    occupancy_aware = True  # use as given: no fill model on top

    def __init__(self, device=GPU, d=10.0, w=10.0, u=0.5):
        self.device, self.d, self.w, self.u = device, d, w, u

    def dispatch_us(self, node):
        return 1.0

    def kernel_us(self, node):
        if is_view(node) or streams.is_event_node(node) or node.op != "call_function":
            return 0.0
        mask = node.args[10]
        return (self.d if mask[0] else 0.0) + (self.w if mask[1] else 0.0)

    def utilization(self, node):
        return 0.05 if streams.is_event_node(node) else self.u


def run(gm, cost, contention):
    lowered = lower([("g.bw", gm)], cost)
    return simulate(lowered.graph, Contention() if contention else None)


# --- exactness on the zoo ------------------------------------------------------------------------------
_OPTIMIZED = {}


def optimized_zoo_model(name):
    """(model, inputs, loss_fn, optimized), once per model (dynamo takes most of the time)."""
    if name not in _OPTIMIZED:
        model, inputs, loss_fn = models.build(name, 2, tiny=True)
        _OPTIMIZED[name] = model, inputs, loss_fn, fxdream.optimize(model, inputs, passes=[PASS], training=True,
                                                                    cost=None)
    return _OPTIMIZED[name]


@pytest.mark.parametrize("name", ZOO)
def test_split_gives_the_same_gradients_on_every_zoo_convnet(name):
    model, inputs, loss_fn, optimized = optimized_zoo_model(name)
    (row,) = [r for r in optimized.report.passes if r.phase == "bw"]
    assert row.applied and row.reason.startswith("CPU: no concurrent streams"), row.reason
    assert_same_training_step(model, optimized, inputs, loss_fn)
    # bitwise: the captured backward and the rewritten one on the same inputs
    (captured,) = optimized.captured
    rewritten = optimized.rewritten_graphs[(0, "bw")]
    assert streams.stream_summary(rewritten).get(1, 0) > 0
    assert not streams.check_stream_order(rewritten)
    args = backward_inputs(captured)
    with torch.no_grad():
        expected, actual = captured.backward(*args), rewritten(*args)
    for e, a in zip(expected, actual):
        assert (e is None and a is None) or torch.equal(e, a)


def test_each_convolution_backward_becomes_dgrad_and_wgrad_with_events():
    gm, _ = three_layer_backward()
    new, sites, notes = aux.split(copy_graph_module(gm))
    assert len(sites) == 3 and not notes
    calls = [n for n in new.graph.nodes if n.op == "call_function" and not is_view(n)]
    masks = [(streams.node_stream(n), list(n.args[10])) for n in calls if getattr(n.target, "overloadpacket", None)
             is aten.convolution_backward]
    assert masks == [(1, [False, True, False]), (0, [True, False, False])] * 3
    events = [(n.target.__name__, streams.node_stream(n)) for n in calls if streams.is_event_node(n)]
    # per site: record on 0, wait on 1 (fork); record on 1 (join); the main stream's wait
    assert events.count(("record_event", 0)) == 3 and events.count(("wait_event", 1)) == 3
    assert events.count(("record_event", 1)) == 3 and events.count(("wait_event", 0)) == 3
    for site in sites:  # the join's wait keeps the weight gradient's inputs alive
        assert site.wait.args[3:] == site.wgrad.args[:3]


def test_first_convolution_without_data_gradient_is_left_alone():
    gm, _ = three_layer_backward()
    last = [n for n in gm.graph.nodes if n.target is CONV_BW][-1]
    last.args = last.args[:10] + ([False, True, False],)
    sites, notes = aux.find_sites(gm.graph)
    assert len(sites) == 2 and "no data gradient to overlap with" in notes[0]


# --- the ordering checker -----------------------------------------------------------------------------
def _wait_nodes(gm, stream):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is streams.wait_event
            and n.args[2] == stream]


def test_checker_accepts_the_rewrite_and_rejects_a_missing_join():
    gm, _ = three_layer_backward()
    new, _, _ = aux.split(copy_graph_module(gm))
    assert streams.check_stream_order(new) == []
    last_join = _wait_nodes(new, 0)[-1]
    new.graph.erase_node(last_join)
    problems = streams.check_stream_order(new)
    assert problems and problems[0].node == "output" and problems[0].produced_on == 1
    assert "has not waited" in str(problems[0])


def test_checker_rejects_a_use_of_the_weight_gradient_before_its_wait():
    gm, _ = three_layer_backward()
    new, sites, _ = aux.split(copy_graph_module(gm))
    dw = next(u for u in sites[0].wgrad.users)  # getitem(wgrad, 1), a view on stream 1
    with new.graph.inserting_after(dw):
        early = new.graph.call_function(aten.mul.Tensor, (dw, 2.0))  # on stream 0, before the wait
    problems = streams.check_stream_order(new)
    assert [(p.node, p.value, p.produced_on, p.used_on) for p in problems] == [(early.name, dw.name, 1, 0)]


def test_checker_rejects_the_aux_stream_reading_before_its_fork_wait():
    gm, _ = three_layer_backward()
    new, sites, _ = aux.split(copy_graph_module(gm))
    fork_wait = next(n for n in _wait_nodes(new, 1) if n.args[0] is sites[1].fork)
    new.graph.erase_node(fork_wait)
    problems = streams.check_stream_order(new)
    assert {p.node for p in problems} == {sites[1].wgrad.name}  # reads dx3, made on stream 0


def test_checker_rejects_an_in_place_write_while_the_aux_stream_reads():
    gm, _ = three_layer_backward()
    new, sites, _ = aux.split(copy_graph_module(gm))
    grad = sites[1].wgrad.args[0]  # dx3: read by wgrad 2 on stream 1
    with new.graph.inserting_after(sites[1].dgrad):
        new.graph.call_function(aten.mul_.Tensor, (grad, 0.0))
    problems = streams.check_stream_order(new)
    assert any("overwritten on stream 0" in str(p) for p in problems)


# --- simulation, by hand -------------------------------------------------------------------------------
def test_two_stream_simulation_of_three_layers_by_hand():
    """Host 1 µs per node; fused conv_bw 20 µs; dgrad 10, wgrad 10; event markers 0 µs.

    Baseline: kernels [1,21] [21,41] [41,61] → 61 µs.
    Split (24 nodes: per layer fork, aux wait, wgrad, join, dgrad, + waits and getitems):
    wgrad3 [3,13] ∥ dgrad3 [5,15]; wgrad2 ∥ dgrad2 [15,25]; wgrad1 ∥ dgrad1 [25,35] → 35 µs.
    With contention: fills 0.5 + 0.5 fit the device: 35 µs again; fills 1 + 1: processor
    sharing: wgrad3 alone [3,5], then both at half speed: wgrad3 ends 21, dgrad3 23; layers
    2 and 1 start together and share: 23 → 43 → 63 µs, worse than one stream (61)."""
    gm, _ = three_layer_backward()
    new, _, _ = aux.split(copy_graph_module(gm))
    assert run(gm, ToyCost(), contention=False).makespan_us == pytest.approx(61.0)
    assert run(gm, ToyCost(), contention=True).makespan_us == pytest.approx(61.0)
    assert run(new, ToyCost(), contention=False).makespan_us == pytest.approx(35.0)
    timeline = run(new, ToyCost(u=0.5), contention=True)
    assert timeline.makespan_us == pytest.approx(35.0)
    assert timeline.times["g.bw:convolution_backward_on_stream1:k"] == pytest.approx((3.0, 13.0))
    shared = run(new, ToyCost(u=1.0), contention=True)
    assert shared.times["g.bw:convolution_backward_on_stream1:k"] == pytest.approx((3.0, 21.0))
    assert shared.times["g.bw:convolution_backward_default:k"] == pytest.approx((5.0, 23.0))
    assert shared.makespan_us == pytest.approx(63.0)
    resources = {t.resource for t in lower([("g.bw", new)], ToyCost()).graph.tasks}
    assert resources == {"cpu:0", "stream:0", "stream:1"}


def test_overlap_keeps_exactly_the_buffer_held_for_the_aux_stream():
    """Activations 1x8x4x4 float32 = 512 B, 1x1 weights 8x8 = 256 B; no contention.

    Baseline peak at 41 µs (layer 1 starts; dx3 freed as its last reader ends):
    dw3 + dx2 + dw2 + dx1 + dw1 = 1792 B. Split: at 25 µs layer 1's dgrad and wgrad allocate
    dx1 and dw1 while dx3 is still held, by the main stream's wait for wgrad 2 (after dgrad 1):
    peak 2304 B = baseline + 512 B, exactly dx3."""
    gm, _ = three_layer_backward()
    new, _, _ = aux.split(copy_graph_module(gm))
    before, after = run(gm, ToyCost(), False), run(new, ToyCost(), False)
    act, weight = 1 * 8 * 4 * 4 * 4, 8 * 8 * 4
    assert before.peak_memory_bytes == 2 * act + 3 * weight == 1792
    assert after.peak_memory_bytes == before.peak_memory_bytes + act
    assert max(m for t, m in after.memory_curve if t == 25.0) == 3 * act + 3 * weight


def _ctx(**kw):
    defaults = dict(device="cuda", training=True, phase="bw", cost_model=ToyCost(), forced=False)
    defaults.update(kw)
    return PassContext(**defaults)


def test_pass_applies_when_predicted_faster_and_declines_over_the_memory_budget():
    gm, _ = three_layer_backward()
    result = aux.AuxStreamBackward()(copy_graph_module(gm), _ctx())
    assert result.modified and "predicted on toy-gpu: 0.061 → 0.035 ms (-42.6 %)" in result.reason
    tight = aux.AuxStreamBackward()(copy_graph_module(gm), _ctx(memory_budget=2000, forced=True))
    assert not tight.modified
    assert "exceeds memory_budget" in tight.reason and "+0.00 MiB" in tight.reason


def test_auto_declines_a_predicted_loss_and_forced_applies_it():
    gm, _ = three_layer_backward()
    slow = ToyCost(u=1.0)  # full contention: 63 µs against 61
    declined = aux.AuxStreamBackward()(copy_graph_module(gm), _ctx(cost_model=slow))
    assert not declined.modified and declined.reason.startswith("predicted slower: 2.0 µs (3.3 %) more")
    forced = aux.AuxStreamBackward()(copy_graph_module(gm), _ctx(cost_model=slow, forced=True))
    assert forced.modified and "(forced: predicted slower, 2.0 µs more)" in forced.reason
    always = aux.AuxStreamBackward(force=True)(copy_graph_module(gm), _ctx(cost_model=slow))
    assert always.modified


def test_on_cpu_auto_says_no_streams_and_forced_rewrites_with_a_gpu_prediction():
    gm, args = three_layer_backward()
    ctx = dict(device="cpu", cost_model=None)
    auto = aux.AuxStreamBackward()(copy_graph_module(gm), _ctx(**ctx))
    assert not auto.modified and auto.reason.startswith("CPU: no concurrent streams: not applied (predicted on h100")
    forced = aux.AuxStreamBackward()(copy_graph_module(gm), _ctx(forced=True, **ctx))
    assert forced.modified and forced.reason.startswith("CPU: no concurrent streams: split 3 convolution_backward")
    for e, a in zip(gm(*args), forced.graph_module(*args)):
        assert torch.equal(e, a)


def test_applies_only_to_backward_graphs():
    p = aux.AuxStreamBackward()
    assert "backward graphs" in p.applies_to(PassContext(training=True, phase="fw"))
    assert "backward graphs" in p.applies_to(PassContext(training=False, phase="fw"))
    assert p.applies_to(PassContext(training=True, phase="bw")) is None
    assert PASS in available_passes()


# --- the fill model and the crossover formula ---------------------------------------------------------
def test_fill_model_of_dgrad_and_split_k_wgrad():
    gm, _ = conv_backward_graph(layers=1, channels=256, pixels=8)
    cb = next(n for n in gm.graph.nodes if n.target is CONV_BW)
    dgrad, wgrad = occupancy.gemms_of(cb)
    assert (dgrad.m, dgrad.n, dgrad.k) == (64, 256, 256) and dgrad.blocks() == 2
    assert (wgrad.m, wgrad.n, wgrad.k) == (256, 256, 64) and wgrad.blocks() == 4  # K < 1024: no split
    assert occupancy.Gemm("wgrad", 256, 256, 4096, split_k=True).blocks() == 16
    assert occupancy.Gemm("wgrad", 256, 256, 4096, split_k=True).workspace_bytes() == 3 * 256 * 256 * 4
    assert dgrad.fill(132) == pytest.approx(2 / 132) and occupancy.occupancy(cb, 4) == pytest.approx(2 / 3)


def test_crossover_formula_on_a_toy_device():
    """One 1x1 conv, 128 → 128 channels, 8x8 pixels, captured at batch 2, on 4 SMs at 1 TFLOP/s.

    dgrad: M = 64b, N = K = 128: 2.097152·b µs of work, fill min(1, ceil(64b/128)/4);
    wgrad: M = N = 128, K = 64b, split max(1, floor(64b/1024)), fill min(1, split/4).
    C = 1 (conv) + 4 (graph call) µs (a getitem is Python tuple indexing: free); dC = 4 event calls + one more convolution
    call with its stream switch; M = 2 markers of the 0 µs floor. Device-bound from b = 2;
    from b = 7 dgrad fills the device and the gain is O(b) = dgrad · (1 - fill_w) > 0 until
    b = 64, where 4 splits fill it too: predicted to help for 2 ≤ batch ≤ 63."""
    device = DeviceSpec("toy", "cuda", {"float32": 1e12}, 1e18, launch_overhead_us=0.0,
                        dispatch_overhead_us=1.0, kernel_min_us=0.0, num_sms=4, memory_bytes=2**30)
    one, _ = conv_backward_graph(layers=1, channels=128, pixels=8, batch=2)
    terms = model_terms([one], device, b0=2)
    assert terms["sites"] == 1 and terms["C"] == pytest.approx(5.0) and terms["M"] == 0.0
    assert terms["dC"] == pytest.approx(4 * occupancy.EVENT_HOST_US + 1.0 + occupancy.STREAM_SWITCH_HOST_US)
    expression, definitions, gain = formula(terms)
    assert "Max(5.0, G(b))" in str(expression) and "O(b)" in str(expression)
    work = 2 * 64 * 128 * 128 / 1e12 * 1e6

    def by_hand(batch):
        fd = min(1.0, math.ceil(64 * batch / 128) / 4)
        fw = min(1.0, max(1, 64 * batch // 1024) / 4)
        d, w = work * batch / fd, work * batch / fw
        g, o = d + w, min(d, w) * min(1.0, 2 - fd - fw)
        return max(5.0, g) - max(5.0 + terms["dC"], g - o)
    for batch in (1, 2, 7, 16, 40, 63, 64, 100):
        assert gain(batch) == pytest.approx(by_hand(batch)), batch
    assert float(definitions["G"].subs(B, 2)) == pytest.approx(2 * work * 2 / 0.25)
    assert gain(1) < 0 < gain(2) and gain(63) > 0 >= gain(64)
    result = crossover_of_graphs([one], device, b0=2, name="toy", max_batch=200)
    assert result.bound == 63 and result.interval == (2, 63)
    assert result.text.startswith("toy: aux_stream_backward is predicted to help for 2 ≤ batch ≤ 63 on toy")


def test_crossover_formula_on_a_device_fitted_to_measured_kernels():
    """The toy conv on a spec fitted to measured kernels (startup 3 µs, 50 % of the roofline for
    convolutions): each kernel is 3 + work / 0.5 whatever its fill, as the simulator costs it;
    the fill still sets how much of the shorter gradient the other stream hides."""
    device = DeviceSpec("toy", "cuda", {"float32": 1e12}, 1e18, launch_overhead_us=0.0,
                        dispatch_overhead_us=1.0, kernel_min_us=0.0, num_sms=4, memory_bytes=2**30,
                        roofline_share={"conv": 0.5, "conv_1x1": 0.5}, kernel_startup_us={"conv": 3.0, "conv_1x1": 3.0},
                        kernels_measured=True)
    one, _ = conv_backward_graph(layers=1, channels=128, pixels=8, batch=2)
    terms = model_terms([one], device, b0=2)
    _, definitions, gain = formula(terms)
    work = 2 * 64 * 128 * 128 / 1e12 * 1e6

    def by_hand(batch):
        fd = min(1.0, math.ceil(64 * batch / 128) / 4)
        fw = min(1.0, max(1, 64 * batch // 1024) / 4)
        d = w = 3.0 + work * batch / 0.5
        g, o = d + w, min(d, w) * min(1.0, 2 - fd - fw)
        return max(5.0, g) - max(5.0 + terms["dC"], g - o)
    for batch in (1, 2, 16, 64, 100):
        assert gain(batch) == pytest.approx(by_hand(batch)), batch
    assert float(definitions["G"].subs(B, 2)) == pytest.approx(2 * (3.0 + 2 * work / 0.5))
    simulator = occupancy.OccupancyAware(Analytic(device))
    kernels = sum(simulator.kernel_us(n) for n in one.graph.nodes if n.op == "call_function")
    assert float(definitions["G"].subs(B, 2)) == pytest.approx(kernels)


def test_the_formula_costs_a_batch_norm_backward_as_the_simulator_does():
    """G(b)'s kernels outside the GEMMs take their traffic as the simulator does
    (``kernel_bytes``: a training batch norm's backward passes over its data more than once)."""
    device = DeviceSpec("toy", "cuda", {"float32": 1e12}, 1e9, launch_overhead_us=0.0,
                        dispatch_overhead_us=1.0, kernel_min_us=0.0, num_sms=4, memory_bytes=2**30)
    graph = fx.Graph()
    grad, x, w, mean, invstd = (graph.placeholder(n) for n in ("g", "x", "w", "mean", "invstd"))
    node = graph.call_function(torch.ops.aten.native_batch_norm_backward.default,
                               (grad, x, w, None, None, mean, invstd, True, 1e-5, [True, True, True]))
    graph.output(node)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    RecordValues(gm).run(torch.randn(2, 4, 8, 8), torch.randn(2, 4, 8, 8), torch.randn(4), torch.randn(4),
                         torch.rand(4))
    symbolic = float(_Symbolic(device, b0=2).kernel(node).subs(B, 2))
    simulator = occupancy.OccupancyAware(Analytic(device)).kernel_us(node)
    assert symbolic == pytest.approx(simulator)
    # three float32 tensors of 512 elements, their bytes x 3.3 for the backward's passes
    assert simulator > 3 * 3 * 512 * 4 / 1e9 * 1e6


def test_crossover_of_a_captured_model_reads_like_the_issue_asks():
    captured = optimized_zoo_model("mnist_convnet")[3].captured
    expression, bound, text = crossover(captured, device="h100", max_batch=256)
    assert "G(b)" in str(expression) and "O(b)" in str(expression)
    assert "aux_stream_backward is predicted" in text and "on h100" in text and "simulator" in text
    assert bound is None or 1 <= bound <= 256
    with pytest.raises(ValueError, match="GPU DeviceSpec"):
        crossover(captured, device="cpu")


def test_crossover_of_a_module_with_its_inputs_equals_that_of_its_capture_and_runs_nothing():
    net, inputs, _ = models.build("mnist_convnet", 4)
    captured = fxdream.capture(net.train(), inputs, training=True)
    from_module = crossover(net, device="h100", max_batch=64, example_inputs=inputs)
    assert str(from_module[0]) == str(crossover(captured, device="h100", max_batch=64)[0])
    assert all(p.device.type == "cpu" for p in net.parameters())  # a meta copy was captured
    with pytest.raises(ValueError, match="crossover of a Sequential needs its example_inputs"):
        crossover(torch.nn.Sequential(torch.nn.Linear(2, 2)), device="h100")
    assert str(crossover(net, device="h100", batch=4, max_batch=64, example_inputs=inputs)[0]) == str(from_module[0])
    with pytest.raises(ValueError, match="batch=32, but the example holds batch 4"):
        crossover(net, device="h100", batch=32, example_inputs=inputs)



class BranchesOnAValue(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv, self.head = torch.nn.Conv2d(3, 8, 3), torch.nn.Linear(8, 2)

    def forward(self, x):
        y = torch.relu(self.conv(x))
        if y.mean() > 0.1:  # reads a value: no capture on the meta device
            y = y * 2
        return self.head(y.mean((2, 3)))


def test_crossover_of_a_module_that_reads_values_is_captured_on_its_data_and_says_so():
    x = torch.randn(4, 3, 8, 8, requires_grad=True)  # a data gradient too: a convolution to split
    found = crossover(BranchesOnAValue(), device="h100", max_batch=64, example_inputs=(x,))
    assert "1 convolutions split" in found.text
    assert "captured on the example's data here, not on the meta device" in found.text
    lstm = torch.nn.LSTM(8, 16)  # runs eagerly in training: no backward graph, nothing to split
    assert "nothing to split" in crossover(lstm, device="h100", example_inputs=(torch.randn(5, 3, 8),)).text


# --- CUDA: real streams -----------------------------------------------------------------------------
@pytest.mark.cuda
def test_cuda_events_order_the_streams():
    x = torch.zeros(1 << 20, device="cuda")
    torch.cuda._sleep(50_000_000)  # the main stream is busy for a while...
    x.fill_(1.0)                   # ...then writes x
    fork = streams.record_event("cuda", 0)
    streams.wait_event(fork, "cuda", 1)
    y = streams.OnStream(aten.mul.Tensor, 1)(x, 2.0)  # must see x == 1
    join = streams.record_event("cuda", 1)
    streams.wait_event(join, "cuda", 0, x)
    assert y.sum().item() == 2.0 * x.numel()
    assert streams.get_stream("cuda", 1) != torch.cuda.current_stream()


@pytest.mark.cuda
@pytest.mark.parametrize("name", ("resnet18", "mnist_convnet"))
def test_cuda_gradients_equal(name, no_tf32):
    model, inputs, loss_fn = models.build(name, 4, tiny=True, device="cuda")
    optimized = fxdream.optimize(model, inputs, passes=[PASS], training=True, cost="analytic")
    (row,) = [r for r in optimized.report.passes if r.phase == "bw"]
    assert row.applied and "CPU" not in row.reason, row.reason
    assert_same_training_step(model, optimized, inputs, loss_fn)
    (captured,) = optimized.captured
    rewritten = optimized.rewritten_graphs[(0, "bw")]
    args = backward_inputs(captured)
    with torch.no_grad(), torch.backends.cudnn.flags(enabled=True, deterministic=True, benchmark=False):
        expected, actual = captured.backward(*args), rewritten(*args)
    torch.cuda.synchronize()
    for e, a in zip(expected, actual):  # dgrad and wgrad are separate cuDNN calls in both
        assert (e is None and a is None) or torch.equal(e, a)


def _memory_after_steps(module, inputs, loss_fn, steps):
    sizes = []
    for _ in range(steps):
        for p in module.parameters():
            p.grad = None
        loss_fn(module(*inputs)).backward()
        torch.cuda.synchronize()
        sizes.append(torch.cuda.memory_allocated())
    return sizes


@pytest.mark.cuda
@pytest.mark.parametrize("passes", ([PASS], [PASS, "cuda_graphs"]))
def test_cuda_memory_stays_flat_over_100_iterations(passes, no_tf32):
    if "cuda_graphs" in passes and "cuda_graphs" not in available_passes():
        pytest.skip("no cuda_graphs pass")
    model, inputs, loss_fn = models.build("resnet18", 4, tiny=True, device="cuda")
    reference = copy.deepcopy(model)
    optimized = fxdream.optimize(model, inputs, passes=passes, training=True, cost="analytic")
    rows = {r.name: r for r in optimized.report.passes if r.phase == "bw"}
    assert rows[PASS].applied, rows[PASS].reason
    warm = _memory_after_steps(optimized, inputs, loss_fn, 5)
    sizes = _memory_after_steps(optimized, inputs, loss_fn, 100)
    assert max(sizes) <= warm[-1] and sizes[-1] == warm[-1], (warm, sizes[::10])
    assert_same_training_step(reference, optimized, inputs, loss_fn)


class FourConvs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Conv2d(c, 64, 3, padding=1),
                                                              torch.nn.BatchNorm2d(64), torch.nn.ReLU())
                                          for c in (3, 64, 64, 64)])

    def forward(self, x):
        return self.body(x).mean((2, 3))


def test_the_rows_predicted_delta_is_the_whole_steps_and_the_pass_judges_the_backward_in_its_step():
    # on a GPU the backward starts behind the forward's queued kernels, which hide the host work
    # the split adds: a backward predicted alone from an empty queue can differ from the step in sign
    with torch.device("meta"):
        model, x = FourConvs().train(), torch.randn(32, 3, 56, 56)
    kwargs = dict(device="h100", training=True, optimizer=None)
    before = fxdream.simulate(model, (x,), **kwargs)
    after = fxdream.simulate(model, (x,), passes=["aux_stream_backward"], **kwargs)
    row = next(r for r in after.passes if r.name == "aux_stream_backward" and r.phase == "bw")
    assert row.applied and "(the step: forward and backward)" in row.reason
    assert row.predicted_delta_us == pytest.approx((after.time_ms - before.time_ms) * 1e3, abs=1e-6)
