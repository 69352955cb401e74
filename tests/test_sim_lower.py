"""Lowering FX graphs to task graphs, with expected makespans and memory worked out by hand."""
import dataclasses

import pytest
import torch
import torch.fx as fx
from conftest import RecordValues, TwoSubgraphs, graph_with_values

import fxdream
from fxdream.ir.nodes import is_view
from fxdream.sim.cost.devices import DeviceSpec, get_device
from fxdream.sim.lower import STREAM, lower
from fxdream.sim.optimizer_step import ADAM, PLAIN_SGD, SGD, OptimizerModel, append_optimizer_step
from fxdream.sim.simulate import Contention, simulate
from fxdream.sim.taskgraph import DepKind, TaskGraph, TaskKind

aten = torch.ops.aten
GPU = DeviceSpec("toy-gpu", "cuda", {"float32": 1e12}, 1e9, launch_overhead_us=0.0,
                 dispatch_overhead_us=1.0, kernel_min_us=0.0, num_sms=1, memory_bytes=2**30)
CPU = DeviceSpec("toy-cpu", "cpu", {"float32": 1e9}, 1e9, launch_overhead_us=0.0,
                 dispatch_overhead_us=1.0, kernel_min_us=0.0, num_sms=None, memory_bytes=2**30)


class FixedCost:
    """Every op: 1 µs dispatch; every kernel 10 µs; views only dispatch."""
    def __init__(self, device):
        self.device = device

    def dispatch_us(self, node):
        return 1.0

    def kernel_us(self, node):
        return 0.0 if is_view(node) else 10.0

    def utilization(self, node):
        return 1.0


def _call(graph, target, args, name):
    return graph.create_node("call_function", target, args, name=name)


def _relu_view_add(graph, x):
    r = _call(graph, aten.relu.default, (x,), "relu")
    v = _call(graph, aten.view.default, (r, [4]), "view")
    return _call(graph, aten.add.Tensor, (v, x), "add")


def test_gpu_lowering_launch_then_kernel_per_op_and_views_cost_dispatch_only():
    lowered = lower([("g.fw", graph_with_values(_relu_view_add, (4,)))], FixedCost(GPU))
    kinds = [(t.name, t.kind, t.resource) for t in lowered.graph.tasks]
    assert kinds == [("g.fw:relu", TaskKind.CPU, "cpu:0"), ("g.fw:relu:k", TaskKind.GPU, "stream:0"),
                     ("g.fw:view", TaskKind.CPU, "cpu:0"),
                     ("g.fw:add", TaskKind.CPU, "cpu:0"), ("g.fw:add:k", TaskKind.GPU, "stream:0")]
    assert lowered.graph.dep_kind("g.fw:relu", "g.fw:relu:k") is DepKind.LAUNCH
    timeline = simulate(lowered.graph)
    # cpu: relu [0,1] view [1,2] add [2,3]; stream 0: relu [1,11], add [11,21]
    assert timeline.makespan_us == pytest.approx(21.0)


def test_cpu_lowering_runs_kernels_on_the_launching_thread():
    lowered = lower([("g.fw", graph_with_values(_relu_view_add, (4,)))], FixedCost(CPU))
    assert [t.resource for t in lowered.graph.tasks] == ["cpu:0"] * 3
    # relu 1+10, view 1, add 1+10, one after the other
    assert simulate(lowered.graph).makespan_us == pytest.approx(23.0)


def test_memory_outputs_allocated_at_start_freed_after_last_use_through_views():
    lowered = lower([("g.fw", graph_with_values(_relu_view_add, (4,)))], FixedCost(GPU))
    assert lowered.static_bytes == 16            # x: 4 floats
    relu, add = lowered.graph.task("g.fw:relu:k"), lowered.graph.task("g.fw:add:k")
    assert (relu.mem_alloc, relu.mem_free) == (16, 0)
    # relu's buffer is last read (through the view) by add; add's own output leaves the graph
    assert (add.mem_alloc, add.mem_free) == (16, 16)
    timeline = simulate(lowered.graph, initial_memory_bytes=lowered.static_bytes)
    assert timeline.peak_memory_bytes == 16 + 16 + 16


def _forward_and_backward(returned: str) -> list[tuple[str, fx.GraphModule]]:
    """aot_autograd's shape: the forward returns its caller's output, then what the backward saves
    (relu); the backward reads the saved relu and its incoming gradient (``tangents_1``)."""
    fw, bw = fx.Graph(), fx.Graph()
    x = fw.placeholder("x")
    relu = _call(fw, aten.relu.default, (x,), "relu")
    neg = _call(fw, aten.neg.default, (x,), "neg")
    fw.output((relu if returned == "relu" else neg, relu))
    saved, grad = bw.placeholder("relu"), bw.placeholder("tangents_1")
    bw.output((_call(bw, aten.mul.Tensor, (grad, saved), "mul"),))
    fw_gm, bw_gm = fx.GraphModule(torch.nn.Module(), fw), fx.GraphModule(torch.nn.Module(), bw)
    RecordValues(fw_gm).run(torch.randn(4))
    RecordValues(bw_gm).run(torch.randn(4), torch.randn(4))
    return [("g.fw", fw_gm), ("g.bw", bw_gm)]


@pytest.mark.parametrize("returned, freed_by_backward", [("neg", 16), ("relu", 0)])
def test_a_saved_value_is_freed_at_its_last_use_unless_the_forward_returned_it(returned, freed_by_backward):
    """The caller holds what the forward returned (the model's output) through the backward, so
    a value both returned and saved lives to the step's end; one only saved dies where the
    backward last reads it."""
    lowered = lower(_forward_and_backward(returned), FixedCost(CPU))
    assert lowered.graph.task("g.bw:mul").mem_free == freed_by_backward
    # x (16 B) static; relu and neg 16 B each from the forward, mul's 16 B in the backward
    timeline = simulate(lowered.graph, initial_memory_bytes=lowered.static_bytes)
    assert timeline.peak_memory_bytes == 16 + 16 + 16 + 16


def _two_branches(graph, x):
    a = _call(graph, aten.relu.default, (x,), "relu")
    b = _call(graph, aten.neg.default, (x,), "neg")
    return _call(graph, aten.add.Tensor, (a, b), "add")


def _two_stream_graph():
    gm = graph_with_values(_two_branches, (4,))
    next(n for n in gm.graph.nodes if n.name == "neg").meta[STREAM] = 1
    return gm


def test_cross_stream_consumer_waits_on_an_event():
    lowered = lower([("g.fw", _two_stream_graph())], FixedCost(GPU))
    assert lowered.graph.task("g.fw:neg:k").resource == "stream:1"
    assert lowered.graph.dep_kind("g.fw:neg:k", "g.fw:add:k") is DepKind.EVENT
    # launches [0,1] [1,2] [2,3]; relu [1,11] on s0, neg [2,12] on s1; add waits for neg: [12,22]
    assert simulate(lowered.graph).makespan_us == pytest.approx(22.0)


def test_contention_slows_overlapping_kernels():
    lowered = lower([("g.fw", _two_stream_graph())], FixedCost(GPU))
    # relu alone [1,2] does 1 µs of work; from 2 both share the device at rate 1/2:
    # relu's 9 µs left end at 2 + 18 = 20; neg then has 10 - 9 = 1 µs left → 21; add [21,31]
    assert simulate(lowered.graph, Contention()).makespan_us == pytest.approx(31.0)


def test_host_sync_op_makes_the_cpu_wait_for_the_kernel():
    def build(graph, x):
        s = _call(graph, aten.sum.default, (x,), "sum")
        item = _call(graph, aten._local_scalar_dense.default, (s,), "_local_scalar_dense")
        return _call(graph, aten.relu.default, (x,), "relu"), item
    lowered = lower([("g.fw", graph_with_values(build, (4,)))], FixedCost(GPU))
    sync = lowered.graph.task("g.fw:_local_scalar_dense:sync")
    assert sync.kind is TaskKind.SYNC
    # sum: launch [0,1] kernel [1,11]; item launch [1,2], kernel [11,21], sync until 21;
    # relu launch [21,22] kernel [22,32]
    assert simulate(lowered.graph).makespan_us == pytest.approx(32.0)


def test_optimizer_step_follows_the_backward_as_its_own_tasks():
    def build(graph, x):
        return _call(graph, aten.neg.default, (x,), "neg"), None
    bw = graph_with_values(build, (1000,))  # one "gradient" of 4000 bytes
    sgd = OptimizerModel("sgd", bytes_per_grad_byte=5.0, kernels_per_param=2, foreach=False)
    lowered = lower([("g.bw", bw)], FixedCost(GPU), optimizer=sgd)
    step = lowered.graph.task("optim:0:k")
    assert step.phase == "optim"
    # 5 x 4000 bytes at 1e9 B/s = 20 µs
    assert step.duration_us == pytest.approx(20.0)


def test_a_gpu_optimizer_step_is_torchs_multi_tensor_ops_over_every_gradient():
    """torch's default on a GPU (foreach): SGD with momentum is three multi-tensor ops over all
    gradients, each moving a third of the 5 bytes per gradient byte and launching one kernel
    per 64 tensors; on a CPU, one update per parameter."""
    def build(graph, *grads):
        return tuple(_call(graph, aten.neg.default, (g,), f"neg{i}") for i, g in enumerate(grads)) + (None,)
    shapes = [(1000,)] * 100  # 100 gradients of 4000 bytes: two launches of 64 tensors at most
    bw = graph_with_values(build, *shapes)
    sgd = OptimizerModel("sgd", bytes_per_grad_byte=5.0, kernels_per_param=2, foreach_ops=3)
    spec = DeviceSpec("toy-gpu", "cuda", {"float32": 1e12}, 1e9, launch_overhead_us=2.0,
                      dispatch_overhead_us=1.0, kernel_min_us=0.0, num_sms=1, memory_bytes=2**30)
    graph = lower([("g.bw", bw)], FixedCost(spec), optimizer=sgd).graph
    hosts = [n for n in graph.select(phase="optim") if not n.endswith(":k")]
    assert len(hosts) == 3
    assert all(graph.task(n).duration_us == pytest.approx(1.0 + 2 * 2.0) for n in hosts)  # a dispatch, 2 launches
    # 5 x 400,000 bytes / 3 at 1e9 B/s
    assert graph.task("optim:0:k").duration_us == pytest.approx(5 * 400_000 / 3 / 1e3)
    on_cpu = lower([("g.bw", bw)], FixedCost(CPU), optimizer=sgd).graph
    assert len(on_cpu.select(phase="optim")) == 100


def test_optimizer_state_is_static_memory_of_its_size_per_updated_parameter():
    def build(graph, x):
        return _call(graph, aten.neg.default, (x,), "neg"), None
    bw = graph_with_values(build, (1000,))  # one "gradient" of 4000 bytes
    without = lower([("g.bw", bw)], FixedCost(GPU)).static_bytes
    momentum = lower([("g.bw", bw)], FixedCost(GPU), optimizer=OptimizerModel("sgd", 5.0, 2, state_copies=1))
    moments = lower([("g.bw", bw)], FixedCost(GPU), optimizer=OptimizerModel("adam", 7.0, 5, state_copies=2))
    assert momentum.static_bytes - without == 4000
    assert moments.static_bytes - without == 8000


def test_optimizer_updates_the_parameters_of_every_subgraph():
    import fxdream
    from fxdream.sim.cost.analytic import Analytic
    from fxdream.sim.cost.devices import get_device
    from fxdream.sim.lower import lower_captured

    captured = fxdream.capture(TwoSubgraphs(), (torch.randn(3, 4),), training=True)
    assert len(captured) == 2
    loop = dataclasses.replace(SGD, foreach=False)
    lowered = lower_captured(captured, Analytic(get_device("h100")), loop)
    updates = [name for name in lowered.graph.select(phase="optim") if not name.endswith(":k")]
    assert len(updates) == 4  # two weights and two biases, one update each


def test_autograd_engine_tasks_surround_a_backward_unless_measured_gaps_hold_them():
    """Engine node 2 µs before the backward, AccumulateGrad 3 µs per gradient after it (two
    gradients here: neg and relu outputs); with measured host gaps the gaps hold that time."""
    import dataclasses

    def build(graph, x):
        return _call(graph, aten.neg.default, (x,), "neg"), _call(graph, aten.relu.default, (x,), "relu")
    bw = graph_with_values(build, (4,))
    device = dataclasses.replace(GPU, autograd_node_us=2.0, accumulate_grad_us=3.0)
    lowered = lower([("g.bw", bw)], FixedCost(device))
    names = [t.name for t in lowered.graph.tasks if t.kind is TaskKind.CPU]
    assert names == ["g.bw:autograd", "g.bw:neg", "g.bw:relu", "g.bw:accumulate_grad"]
    assert lowered.graph.task("g.bw:autograd").duration_us == 2.0
    assert lowered.graph.task("g.bw:accumulate_grad").duration_us == 6.0
    # cpu: engine [0,2], neg [2,3], relu [3,4], accumulate [4,10]; kernels neg [3,13], relu [13,23]
    assert simulate(lowered.graph).makespan_us == pytest.approx(23.0)
    measured = lower([("g.bw", bw)], FixedCost(device), host_gaps={"g.bw": 5.0})
    assert not [t for t in measured.graph.tasks if t.op.startswith("autograd.")]


def test_an_op_returning_a_list_beside_tensors_allocates_every_tensor_in_it():
    """A backward op returning (Tensor, Tensor[]) (``fxdream::lstm_train_backward``): each tensor
    of the list is a buffer, and reading one through two getitems reaches it."""
    import operator

    def build(graph, x):
        split = _call(graph, aten.split.Tensor, (x, 2), "split")  # a list of two (2,) tensors
        pair = graph.call_function(lambda t, parts: (t, parts), (x, split))  # noqa: E731
        pair.meta["val"] = (torch.zeros(4), [torch.zeros(2), torch.zeros(2)])
        inner = graph.call_function(operator.getitem, (pair, 1))
        second = graph.call_function(operator.getitem, (inner, 1))
        return _call(graph, aten.relu.default, (second,), "relu")
    gm = graph_with_values(build, (4,))
    for node in gm.graph.nodes:  # the lambda's value as an op returning (Tensor, Tensor[]) gives it
        if node.op == "call_function" and node.name.startswith("lambda"):
            node.meta["val"] = (torch.zeros(4), [torch.zeros(2), torch.zeros(2)])
    lowered = lower([("g.fw", gm)], FixedCost(CPU))
    pair = next(t for t in lowered.graph.tasks if "lambda" in t.name)
    assert pair.mem_alloc == 16 + 8 + 8  # the tensor and both tensors of its list


@pytest.mark.parametrize("device, extra", [("cpu", 2), ("h100", 1)])
def test_adams_temporaries_are_in_the_optimizer_steps_memory(device, extra):
    """torch's Adam makes sqrt(v) and its quotient before its addcdiv: two temporaries of one
    parameter at a time in its loop (a CPU), sqrt(v) of every parameter at once in its
    multi-tensor step (a GPU). SGD with momentum updates in place."""
    for optimizer, copies in ((ADAM, extra), (SGD, 0), (PLAIN_SGD, 0)):
        tg = TaskGraph()
        append_optimizer_step(tg, [(4096, 1024), (4096, 1024)], get_device(device), optimizer, device != "cpu")
        assert simulate(tg).peak_memory_bytes == copies * 4096 * (1 if device == "cpu" else 2)


def test_plain_sgd_keeps_no_state_and_sgd_with_momentum_one_copy():
    model, x = torch.nn.Linear(256, 256), torch.randn(4, 256)
    weights = sum(p.numel() * 4 for p in model.parameters())
    peaks = {name: fxdream.simulate(model, (x,), device="h100", training=True, optimizer=name).static_bytes
             for name in ("sgd_plain", "sgd", "adam")}
    assert peaks["sgd"] - peaks["sgd_plain"] == weights and peaks["adam"] - peaks["sgd_plain"] == 2 * weights


@pytest.mark.parametrize("device", ["h100", "v100"])
def test_an_output_nothing_reads_is_freed_after_its_kernel_allocates_it(device):
    """max_pool2d's indices (int64, half the conv output's bytes here) are read by nothing: they
    are freed where the pooling kernel ends, on the device's clock. Freed at the getitem's host
    task instead, which runs before the kernel when the host is ahead, they were taken off before
    being added and the peak read 1.25x the conv output instead of 1.75x."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Conv2d(8, 64, 3, padding=1), torch.nn.MaxPool2d(2),
                                    torch.nn.Conv2d(64, 64, 3, padding=1)).eval()
        x = torch.randn(32, 8, 64, 64)
    prediction = fxdream.simulate(model, (x,), device=device, cost="analytic")
    conv_output = 32 * 64 * 64 * 64 * 4
    # during the pooling: the conv output, the pooled values (1/4) and the indices (1/2)
    assert prediction.peak_memory_bytes - prediction.static_bytes == conv_output * 7 // 4
