"""cuda_graphs: partition, the simulator's verdict per region, and region lowering.

CPU tests check partitioning, the lowering of a region by hand, and that the predicted gain
has the seed's shape. The rewrite and the runner: test_cuda_graph_runner.py.
"""

import pytest
import torch
import torch.fx as fx

from fxdream import models
from fxdream.capturing.capture_model import capture
from fxdream.pass_api import PassContext
from fxdream.passes.cuda_graphs.partition import RunnerOptions, partition, replace_regions
from fxdream.passes.cuda_graphs import NEEDS_CUDA, CudaGraphs, annotate_regions, plan, predict_cuda_graph_gain
from fxdream.passes.mark_incompatible import mark_incompatible
from fxdream.sim.prediction import graph_prediction
from fxdream.sim.cost.analytic import Analytic
from fxdream.ir.nodes import is_view
from fxdream.sim.cost.devices import DeviceSpec, get_device
from fxdream.sim.graph_regions import CUDA_GRAPH_REGION, CUDA_GRAPH_STATIC, inline_cuda_graph_runners
from fxdream.sim.lower import lower
from fxdream.sim.simulate import simulate
from fxdream.sim.taskgraph import DepKind, TaskKind
from conftest import graph_with_values
from cuda_graph_cases import ALWAYS, call, chain, names, split_by_syncs

aten = torch.ops.aten
H100 = Analytic(get_device("h100"))
V100 = Analytic(get_device("v100"))


# --- partition ----------------------------------------------------------------------------------

def test_partition_flushes_at_every_marked_node():
    gm = graph_with_values(split_by_syncs, (8,))
    marked = mark_incompatible(gm, PassContext(device="cuda"))
    assert {n.name for n in marked} == {"item", "mul", "nonzero"}
    assert names(partition(gm, marked)) == [["relu", "neg", "total"], ["exp", "add"], ["sigmoid"]]


def test_getitems_stay_with_their_producer_and_a_dropout_splits_training_only():
    def build(g, x):
        r = call(g, aten.relu.default, x, name="relu")
        d = call(g, aten.native_dropout.default, r, 0.5, True, name="dropout")
        out = call(g, __import__("operator").getitem, d, 0, name="drop_out")
        return call(g, aten.neg.default, out, name="neg")
    gm = graph_with_values(build, (8,))
    train = mark_incompatible(gm, PassContext(device="cuda", training=True))
    assert names(partition(gm, train)) == [["relu"], ["neg"]]  # the getitem runs with the dropout
    evaluation = mark_incompatible(gm, PassContext(device="cuda"))
    assert names(partition(gm, evaluation)) == [["relu", "dropout", "drop_out", "neg"]]


def test_region_counts_on_a_captured_training_graph():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.ReLU(),
                                torch.nn.Linear(8, 8), torch.nn.Dropout(0.2), torch.nn.Linear(8, 2))
    captured = capture(model, (torch.randn(4, 8),), training=True)
    ctx = PassContext(device="cuda", training=True, phase="fw")
    regions = partition(captured.forward, mark_incompatible(captured.forward, ctx))
    assert len(regions) == 3  # linear | relu, linear | linear, split by the two dropouts
    bw_ctx = PassContext(device="cuda", training=True, phase="bw")
    assert len(partition(captured.backward, mark_incompatible(captured.backward, bw_ctx))) == 1


# --- the simulator decides --------------------------------------------------------------------

def test_a_region_too_small_to_pay_off_is_skipped_and_reported():
    def build(g, x, w):
        big = chain(12)(g, x)
        s = call(g, aten._local_scalar_dense.default, call(g, aten.sum.default, big, name="sum"), name="item")
        return call(g, aten.neg.default, w, name="lonely"), s
    gm = graph_with_values(build, (16,), (16,))
    ctx = PassContext(device="cuda")
    marked, prediction, kept = plan(gm, ctx, H100)
    first, second = prediction.regions
    assert first.kept and first.kernels == 13 and first.predicted_gain_us > 0
    # one kernel: its launch is traded for an input copy, a graph launch and an output clone
    assert not second.kept and second.predicted_gain_us < 0
    assert second.reason == "skipped: too small to pay off (predicted gain ≤ 0 µs)"
    assert [r for r, _ in kept] == [0]
    assert prediction.after_us < prediction.before_us


def test_on_cpu_the_pass_returns_the_graph_unchanged_with_the_gpu_prediction():
    gm = graph_with_values(chain(20), (16,))
    code = gm.code
    result = CudaGraphs()(gm, PassContext(device="cpu"))
    assert not result.modified and result.graph_module.code == code
    assert result.reason.startswith(f"{NEEDS_CUDA}; predicted on h100 (analytic): ")
    assert "with 1 of 1 region(s)" in result.reason
    assert result.notes[1].startswith("region 0 ((model)): 20 kernels, 1 input(s) copied per call")
    assert result.notes[1].endswith(": kept")


def test_the_prediction_on_a_region_annotated_copy_shows_the_launch_savings():
    gm = graph_with_values(chain(30), (16,))
    flat = annotate_regions(gm, PassContext(device="cpu"))
    assert {n.meta.get(CUDA_GRAPH_REGION) for n in flat.graph.nodes if n.name.startswith("op")} == {0}
    without, _ = graph_prediction(gm, H100)
    with_graphs, _ = graph_prediction(flat, H100)
    launches = 30 * (get_device("h100").launch_overhead_us + get_device("h100").dispatch_overhead_us)
    assert without - with_graphs > 0.5 * launches


def test_predicted_gain_is_large_at_batch_1_and_shrinks_with_the_batch():
    """The seed's shape (+17 % at bs1, +0.3 % at bs128) must come out of the model. The tiny net
    is host-bound on a V100 up to large batches (PyTorch's ~20 µs of host per op), so the large
    batch here is 512, where the kernels outlast the launches and the input copy outweighs them."""
    gains = {}
    for batch in (1, 512):
        model, inputs, _ = models.build("mnist_convnet", batch, tiny=True, device="meta")
        model.eval()
        prediction = predict_cuda_graph_gain(capture(model, inputs), V100, min_gain_us=ALWAYS)
        (region,) = prediction.regions
        assert region.copied_inputs == 1  # the image; weights are read in place
        gains[batch] = region.predicted_gain_us / prediction.before_us
    assert gains[1] > 0.2 and gains[1] > 2 * gains[512]


@pytest.mark.slow
def test_resnet50_gain_shape_on_h100_and_v100():
    for device in ("h100", "v100"):
        gains = []
        for batch in (1, 128):
            model, inputs, _ = models.build("resnet50", batch, device="meta", dtype=torch.float16)
            model.eval()
            prediction = predict_cuda_graph_gain(capture(model, inputs), device, min_gain_us=ALWAYS)
            gains.append(prediction.regions[0].predicted_gain_us / prediction.before_us)
        assert gains[0] > 0.15 and abs(gains[1]) < 0.01, (device, gains)


# --- lowering a region --------------------------------------------------------------------------

TOY = DeviceSpec("toy-gpu", "cuda", {"float32": 1e12}, 1e9, launch_overhead_us=0.0, dispatch_overhead_us=1.0,
                 kernel_min_us=0.0, num_sms=1, memory_bytes=2**30)


class LaunchBound:
    """Dispatch 10 µs per op, kernels 1 µs, a graph launch 2 µs."""
    device = TOY

    def dispatch_us(self, node):
        return 10.0

    def kernel_us(self, node):
        return 0.0 if is_view(node) else 1.0

    def utilization(self, node):
        return 1.0

    def graph_launch_us(self, kernels):
        return 2.0


def _three_ops(g, x):
    a = call(g, aten.relu.default, x, name="relu")
    v = call(g, aten.view.default, a, [4], name="view")
    b = call(g, aten.neg.default, v, name="neg")
    return call(g, aten.add.Tensor, a, b, name="add")


def _regioned(static_input: bool):
    gm = graph_with_values(_three_ops, (4,))
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta[CUDA_GRAPH_REGION] = 0
        if node.op == "placeholder" and static_input:
            node.meta[CUDA_GRAPH_STATIC] = True
    return gm


def test_a_region_lowers_to_one_graph_launch_and_its_kernels():
    eager = lower([("g.fw", graph_with_values(_three_ops, (4,)))], LaunchBound())
    # cpu: 4 dispatches of 10 µs (the view too); kernels relu [10,11], neg [30,31], add [40,41]
    assert simulate(eager.graph).makespan_us == pytest.approx(41.0)

    lowered = lower([("g.fw", _regioned(static_input=True))], LaunchBound())
    tasks = {t.name: t for t in lowered.graph.tasks}
    assert [t.name for t in lowered.graph.tasks if t.kind is TaskKind.CPU] == ["g.fw:cuda_graph0"]
    assert sorted(n for n, t in tasks.items() if t.kind is TaskKind.GPU) == ["g.fw:add:k", "g.fw:neg:k", "g.fw:relu:k"]
    for kernel in ("g.fw:relu:k", "g.fw:neg:k", "g.fw:add:k"):
        assert lowered.graph.dep_kind("g.fw:cuda_graph0", kernel) is DepKind.GRAPH_LAUNCH
    # launch [0,2]; relu [2,3], neg [3,4], add [4,5]
    assert simulate(lowered.graph).makespan_us == pytest.approx(5.0)


def test_measured_costs_replay_a_graph_s_kernels_closer_together():
    """Profiled on a GPU: a region's kernels take their measured time less the per-kernel saving
    of a graph replay (measured once per device), never below the device's smallest kernel."""
    from fxdream.sim.cost.profiled import Profiled
    from fxdream.sim.profile.in_context import HOST
    from fxdream.sim.profile.op_keys import profile_key
    cost = Profiled(get_device("h200"), "cuda")
    gm = _regioned(static_input=True)
    kernels = {"relu": 3.0, "neg": 1.0, "add": 40.0}
    for node in gm.graph.nodes:
        if node.name in kernels:
            key = profile_key(node, "cuda")
            cost.measurements[key], cost.measurements[HOST + key] = kernels[node.name], 5.0
    cost.measurements["__graph_kernel_saving__|cuda"] = 1.5
    cost.measurements["__graph_call__|cuda"] = cost.measurements["__view__|cuda"] = 0.0
    cost._call_overhead_us = 1.0
    lowered = lower([("g.fw", gm)], cost)
    got = {name: lowered.graph.task(f"g.fw:{name}:k").duration_us for name in kernels}
    floor = get_device("h200").kernel_min_us
    assert got == pytest.approx({"relu": max(1.5, min(3.0, floor)), "neg": min(1.0, floor), "add": 38.5})
    eager = lower([("g.fw", graph_with_values(_three_ops, (4,)))], cost)  # outside a graph: as measured
    assert eager.graph.task("g.fw:relu:k").duration_us == 3.0
    assert eager.graph.task("g.fw:relu").duration_us == 1.0 + 5.0  # fx's call + the op's measured host time


def test_a_copied_input_adds_one_copy_and_the_pool_is_static_memory():
    lowered = lower([("g.fw", _regioned(static_input=False))], LaunchBound())
    copy = lowered.graph.task("g.fw:cuda_graph0:copy_in:k")
    assert copy.duration_us == pytest.approx(2 * 16 / 1e9 * 1e6)  # 16 bytes read and written at 1 GB/s
    # copy launch [0,1] (dispatch 1 + launch 0 of the device), copy [1,1.000032];
    # graph launch [1,3]; kernels [3,4] [4,5] [5,6]
    assert simulate(lowered.graph).makespan_us == pytest.approx(6.0)
    # x (16) + pool: its static copy of x (16) + relu, neg, add alive at once (48)
    assert lowered.static_bytes == 16 + 16 + 48
    assert all(t.mem_alloc == 0 and t.mem_free == 0 for t in lowered.graph.tasks)


def test_regions_on_a_cpu_device_lower_as_plain_ops():
    cpu = DeviceSpec("toy-cpu", "cpu", {"float32": 1e9}, 1e9, 0.0, 1.0, 0.0, None, 2**30)

    class Cost(LaunchBound):
        device = cpu
    plain = lower([("g.fw", graph_with_values(_three_ops, (4,)))], Cost())
    regioned = lower([("g.fw", _regioned(True))], Cost())
    assert [t.name for t in regioned.graph.tasks] == [t.name for t in plain.graph.tasks]


def test_the_rewritten_graph_inlines_to_the_same_tasks_as_the_annotated_one():
    gm = graph_with_values(chain(6), (16,))
    rewritten = replace_regions(fx.GraphModule(gm, __import__("copy").deepcopy(gm.graph)),
                         [(0, [f"op{i}" for i in range(6)])], set(), RunnerOptions())
    assert [n.op for n in rewritten.graph.nodes].count("call_module") == 1
    flat = inline_cuda_graph_runners(rewritten)
    names = [t.name for t in lower([("g.fw", flat)], H100).graph.tasks]
    assert names == [t.name for t in lower([("g.fw", rewritten)], H100).graph.tasks]
    assert "g.fw:cuda_graph0" in names and "g.fw:op0" not in names and "g.fw:op0:k" in names
    assert any(n.startswith("g.fw:clone_outputs") for n in names)  # the output leaves: one batched clone


def test_a_non_contiguous_region_is_an_error():
    gm = _regioned(True)
    next(n for n in gm.graph.nodes if n.name == "neg").meta.pop(CUDA_GRAPH_REGION)
    with pytest.raises(ValueError, match="not contiguous"):
        lower([("g.fw", gm)], LaunchBound())
