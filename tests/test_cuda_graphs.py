"""cuda_graphs: partition, the simulator's verdict per region, region lowering, and the runner.

CPU tests check partitioning, the rewrite (the runner falls back to eager on CPU tensors),
the lowering of a region by hand, and that the predicted gain has the seed's shape. Tests
marked cuda check the runner itself on a GPU.
"""

import pytest
import torch
import torch.fx as fx

import fxdream
from fxdream import models
from fxdream.capture import capture
from fxdream.cuda_graph_runner import (CudaGraphFallback, CudaGraphOutputOverwritten, CudaGraphRunner,
                                       clone_outputs, cuda_graph_memory_bytes, describe_runners, runners)
from fxdream.pass_api import PassContext
from fxdream.cuda_graph_partition import RunnerOptions, partition, replace_regions
from fxdream.passes.cuda_graphs import NEEDS_CUDA, CudaGraphs, annotate_regions, plan, predict_cuda_graph_gain
from fxdream.passes.mark_incompatible import mark_incompatible
from fxdream.predict import graph_prediction
from fxdream.sim.cost import Analytic, is_view
from fxdream.sim.devices import DeviceSpec, get_device
from fxdream.sim.graph_regions import CUDA_GRAPH_REGION, CUDA_GRAPH_STATIC, cuda_graph_regions, inline_cuda_graph_runners
from fxdream.sim.lower import lower
from fxdream.sim.simulate import simulate
from fxdream.sim.taskgraph import DepKind, TaskKind
from conftest import graph_with_values

aten = torch.ops.aten
H100 = Analytic(get_device("h100"))
V100 = Analytic(get_device("v100"))
ALWAYS = float("-inf")  # min_gain_us that keeps every region


def _call(graph, target, *args, name=None):
    return graph.create_node("call_function", target, args, name=name)


def _split_by_syncs(g, x):
    """relu, neg | item (host sync) | mul reads the host value | exp, getitem-free | nonzero | sigmoid"""
    a = _call(g, aten.relu.default, x, name="relu")
    b = _call(g, aten.neg.default, a, name="neg")
    s = _call(g, aten._local_scalar_dense.default, _call(g, aten.sum.default, b, name="total"), name="item")
    c = _call(g, aten.mul.Tensor, b, s, name="mul")
    d = _call(g, aten.exp.default, c, name="exp")
    e = _call(g, aten.add.Tensor, d, b, name="add")
    nz = _call(g, aten.nonzero.default, e, name="nonzero")
    f = _call(g, aten.sigmoid.default, e, name="sigmoid")
    return f, nz


def _names(regions):
    return [[n.name for n in r] for r in regions]


# --- partition ----------------------------------------------------------------------------------

def test_partition_flushes_at_every_marked_node():
    gm = graph_with_values(_split_by_syncs, (8,))
    marked = mark_incompatible(gm, PassContext(device="cuda"))
    assert {n.name for n in marked} == {"item", "mul", "nonzero"}
    assert _names(partition(gm, marked)) == [["relu", "neg", "total"], ["exp", "add"], ["sigmoid"]]


def test_getitems_stay_with_their_producer_and_a_dropout_splits_training_only():
    def build(g, x):
        r = _call(g, aten.relu.default, x, name="relu")
        d = _call(g, aten.native_dropout.default, r, 0.5, True, name="dropout")
        out = _call(g, __import__("operator").getitem, d, 0, name="drop_out")
        return _call(g, aten.neg.default, out, name="neg")
    gm = graph_with_values(build, (8,))
    train = mark_incompatible(gm, PassContext(device="cuda", training=True))
    assert _names(partition(gm, train)) == [["relu"], ["neg"]]  # the getitem runs with the dropout
    evaluation = mark_incompatible(gm, PassContext(device="cuda"))
    assert _names(partition(gm, evaluation)) == [["relu", "dropout", "drop_out", "neg"]]


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

def _chain(n_ops):
    def build(g, x):
        y = x
        for i in range(n_ops):
            y = _call(g, aten.relu.default if i % 2 else aten.neg.default, y, name=f"op{i}")
        return y
    return build


def test_a_region_too_small_to_pay_off_is_skipped_and_reported():
    def build(g, x, w):
        big = _chain(12)(g, x)
        s = _call(g, aten._local_scalar_dense.default, _call(g, aten.sum.default, big, name="sum"), name="item")
        return _call(g, aten.neg.default, w, name="lonely"), s
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
    gm = graph_with_values(_chain(20), (16,))
    code = gm.code
    result = CudaGraphs()(gm, PassContext(device="cpu"))
    assert not result.modified and result.graph_module.code == code
    assert result.reason.startswith(f"{NEEDS_CUDA}; predicted on h100 (analytic): ")
    assert "with 1 of 1 region(s)" in result.reason
    assert result.notes[1].startswith("region 0 ((model)): 20 kernels, 1 input(s) copied per call")
    assert result.notes[1].endswith(": kept")


def test_the_prediction_on_a_region_annotated_copy_shows_the_launch_savings():
    gm = graph_with_values(_chain(30), (16,))
    flat = annotate_regions(gm, PassContext(device="cpu"))
    assert {n.meta.get(CUDA_GRAPH_REGION) for n in flat.graph.nodes if n.name.startswith("op")} == {0}
    without, _ = graph_prediction(gm, H100)
    with_graphs, _ = graph_prediction(flat, H100)
    launches = 30 * (get_device("h100").launch_overhead_us + get_device("h100").dispatch_overhead_us)
    assert without - with_graphs > 0.5 * launches


def test_predicted_gain_is_large_at_batch_1_and_shrinks_with_the_batch():
    """The seed's shape (+17 % at bs1, +0.3 % at bs128) must come out of the model."""
    gains = {}
    for batch in (1, 64):
        model, inputs, _ = models.build("mnist_convnet", batch, tiny=True, device="meta")
        model.eval()
        prediction = predict_cuda_graph_gain(capture(model, inputs), V100, min_gain_us=ALWAYS)
        (region,) = prediction.regions
        assert region.copied_inputs == 1  # the image; weights are read in place
        gains[batch] = region.predicted_gain_us / prediction.before_us
    assert gains[1] > 0.2 and gains[1] > 2 * gains[64]


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
    a = _call(g, aten.relu.default, x, name="relu")
    v = _call(g, aten.view.default, a, [4], name="view")
    b = _call(g, aten.neg.default, v, name="neg")
    return _call(g, aten.add.Tensor, a, b, name="add")


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
    gm = graph_with_values(_chain(6), (16,))
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


# --- the rewrite (on CPU the runner runs the region eagerly) -----------------------------------

def test_rewrite_structure_and_numerics_and_which_outputs_are_cloned():
    def build(g, x, w):
        a = _call(g, aten.mm.default, x, w, name="mm")
        b = _call(g, aten.relu.default, a, name="relu")
        s = _call(g, aten._local_scalar_dense.default, _call(g, aten.sum.default, b, name="total"), name="item")
        c = _call(g, aten.mul.Tensor, b, s, name="scale")  # marked: reads a host value
        d = _call(g, aten.tanh.default, _call(g, aten.add.Tensor, c, b, name="add"), name="tanh")
        return d, _call(g, aten.t.default, b, name="bt")
    gm = graph_with_values(build, (4, 4), (4, 4))
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    expected = gm(x, w)
    regions = [(i, [n.name for n in r]) for i, r in enumerate(partition(gm, mark_incompatible(gm, PassContext())))]
    assert [names for _, names in regions] == [["mm", "relu", "total"], ["add", "tanh", "bt"]]
    rewritten = replace_regions(fx.GraphModule(gm, __import__("copy").deepcopy(gm.graph)), regions, {"x1"}, RunnerOptions())
    first, second = runners(rewritten)
    assert first.static_inputs == (False, True)   # x copied in, the "parameter" w read in place
    clones = [n for n in rewritten.graph.nodes if n.target is clone_outputs]
    # region 0: relu leaves the graph through the view "bt" (cloned for it, not for the eager
    # scale or region 1's add); region 1: tanh is cloned, and the view bt leaving the graph
    # is replayed eagerly on relu's clone, so it aliases as in eager mode
    assert [len(c.args) for c in clones] == [1, 1]
    output = next(n for n in rewritten.graph.nodes if n.op == "output")
    bt = output.args[0][1]
    assert bt.target is aten.t.default and bt.args[0].args[0] is clones[0]
    scale = next(n for n in rewritten.graph.nodes if n.name == "scale")
    assert scale.args[0].target.__name__ == "getitem" and scale.args[0].args[0].target == "cuda_graph_0"
    for got, want in zip(rewritten(x, w), expected):
        torch.testing.assert_close(got, want)
    assert first.eager_reason == "CUDA graphs need a CUDA device (no input of the region is on one)"
    assert "runs eagerly" in describe_runners(rewritten)[0]


def test_optimize_on_cpu_reports_the_reason_and_the_prediction():
    model, inputs, _ = models.build("mnist_convnet", 2, tiny=True)
    model.eval()
    optimized = fxdream.optimize(model, inputs, passes=["cuda_graphs"], cost="analytic")
    (row,) = optimized.report.passes
    assert not row.applied and row.reason.startswith(NEEDS_CUDA)
    assert row.notes[0].startswith("predicted on h100 (analytic)")
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs), model(*inputs))


def test_strict_refuses_a_graph_with_marked_nodes():
    gm = graph_with_values(_split_by_syncs, (8,))
    with pytest.raises(CudaGraphFallback, match="3 node\\(s\\) cannot be captured"):
        CudaGraphs(strict=True)(gm, PassContext(device="cpu"))


def test_views_of_graph_inputs_stay_outside_regions_and_weights_are_read_in_place():
    def build(g, x, w, b):  # a linear layer as aot writes it: t(w) then addmm
        t = _call(g, aten.t.default, w, name="w_t")
        y = _call(g, aten.addmm.default, b, x, t, name="addmm")
        return _call(g, aten.relu.default, y, name="relu")
    gm = graph_with_values(build, (2, 4), (3, 4), (3,))
    regions = partition(gm, mark_incompatible(gm, PassContext()))
    assert _names(regions) == [["addmm", "relu"]]
    rewritten = replace_regions(fx.GraphModule(gm, __import__("copy").deepcopy(gm.graph)), [(0, ["addmm", "relu"])],
                         {"x1", "x2"}, RunnerOptions())
    (runner,) = runners(rewritten)
    assert runner.static_inputs == (True, False, True)  # b, x (copied), t(w): a view of a weight
    x, w, b = torch.randn(2, 4), torch.randn(3, 4), torch.randn(3)
    torch.testing.assert_close(rewritten(x, w, b), gm(x, w, b))
    (region,) = cuda_graph_regions(
        inline_cuda_graph_runners(rewritten)).values()
    assert [n.name for n in region.copied_inputs] == ["x0"]


def test_a_view_leaving_the_graph_is_replayed_on_the_clone_of_its_base():
    def build(g, x):
        r = _call(g, aten.relu.default, x, name="relu")
        v = _call(g, aten.slice.Tensor, r, 0, 1, 3, name="part")
        return v, _call(g, aten.neg.default, r, name="neg")
    gm = graph_with_values(build, (4, 2))
    rewritten = replace_regions(fx.GraphModule(gm, __import__("copy").deepcopy(gm.graph)),
                         [(0, ["relu", "part", "neg"])], set(), RunnerOptions())
    (runner,) = runners(rewritten)
    region_outputs = next(n for n in runner.region_graph.graph.nodes if n.op == "output").args[0]
    assert [n.name for n in region_outputs] == ["relu", "neg"]  # the view is not an output
    x = torch.randn(4, 2)
    part, neg = rewritten(x)
    torch.testing.assert_close(part, gm(x)[0])
    assert part.storage_offset() == 2 and part._base is not None  # a view, as in eager mode


class _SimulatedRunner(CudaGraphRunner):
    """The runner's bookkeeping on CPU: "capture" keeps the region, "replay" reruns it into the
    static outputs. Not a test of CUDA graphs themselves (the cuda tests are)."""

    def _find_device(self, args):
        return next((a.device for a in args if isinstance(a, torch.Tensor)), None)

    def _record(self, static, device):
        outputs = tuple(t.clone() for t in self.region_graph(*static))
        region = self.region_graph

        class Replay:
            def replay(self):
                for out, new in zip(outputs, region(*static)):
                    out.copy_(new)
        return Replay(), outputs, sum(t.numel() * t.element_size() for t in outputs)


def test_runner_bookkeeping_copies_static_checks_shapes_cap_and_guard():
    region = graph_with_values(_elementwise, (8,), (8,))
    runner = _SimulatedRunner(region, 0, (False, True), max_shapes=2)
    w = torch.randn(8)
    for _ in range(3):
        x = torch.randn(8)
        torch.testing.assert_close(runner(x, w)[1], x * w)  # x copied in every call, w read in place
    assert (runner.stats()["shapes_captured"], runner.stats()["replays"]) == (1, 3)
    w2 = torch.randn(8)
    torch.testing.assert_close(runner(x, w2)[1], x * w2)  # the weight moved: captured again
    assert runner.stats()["rerecords"] == 1 and runner.stats()["shapes_captured"] == 1
    for n in (4, 16):
        x, w = torch.randn(n), torch.randn(n)
        torch.testing.assert_close(runner(x, w)[1], x * w)
    assert runner.stats()["shapes_captured"] == 2 and runner.stats()["eager_shapes"] == 1
    assert runner.describe().endswith("1 call(s) at 1 further shape(s) ran eagerly (cap 2 shapes)")
    assert runner.memory_bytes() > 0

    guarded = _SimulatedRunner(region, 0, (False, False), guard_outputs=(1,))
    x, y = torch.randn(8), torch.randn(8)
    held = guarded(x, y)[1]
    with pytest.raises(CudaGraphOutputOverwritten, match="output 1 returned by the previous call"):
        guarded(x, y)
    del held
    guarded(x, y)

    strict = _SimulatedRunner(region, 0, (False, False), max_shapes=1, strict=True)
    strict(torch.randn(8), torch.randn(8))
    with pytest.raises(CudaGraphFallback, match="more than 1 input shapes"):
        strict(torch.randn(4), torch.randn(4))


def test_a_failed_capture_runs_the_region_eagerly_once_per_call_with_the_reason():
    class Failing(_SimulatedRunner):
        def _record(self, static, device):
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
    region = graph_with_values(_elementwise, (8,), (8,))
    runner = Failing(region, 0, (False, False))
    x, y = torch.randn(8), torch.randn(8)
    for calls in (1, 2):
        torch.testing.assert_close(runner(x, y)[1], x * y)
        assert runner.stats()["eager_calls"] == calls
    assert runner.eager_reason == "capture failed: RuntimeError: operation not permitted when stream is capturing"
    strict = Failing(region, 0, (False, False), strict=True)
    with pytest.raises(CudaGraphFallback, match="capture failed"):
        strict(x, y)


def test_clone_outputs_copies_with_the_same_strides():
    a, b = torch.randn(3, 2).t(), torch.randn(4)
    ca, cb = clone_outputs(a, b)
    assert ca.stride() == a.stride() and ca.data_ptr() != a.data_ptr()
    torch.testing.assert_close((ca, cb), (a, b))


# --- the runner on a GPU ----------------------------------------------------------------------

def _region(build, *shapes, device="cuda"):
    gm = graph_with_values(build, *shapes)
    return gm.to(device)


def _elementwise(g, x, y):
    return (_call(g, aten.relu.default, _call(g, aten.add.Tensor, x, y)),
            _call(g, aten.mul.Tensor, x, y))


@pytest.mark.cuda
def test_runner_matches_eager_and_replays():
    region = _region(_elementwise, (64,), (64,))
    runner = CudaGraphRunner(region, 0, (False, True))
    x, y = torch.randn(64, device="cuda"), torch.randn(64, device="cuda")
    for _ in range(3):
        x.normal_()
        got = runner(x, y)
        for a, b in zip(got, region(x, y)):
            torch.testing.assert_close(a, b)
    stats = runner.stats()
    assert (stats["shapes_captured"], stats["replays"], stats["eager_calls"]) == (1, 3, 0)
    assert runner.memory_bytes() > 0


@pytest.mark.cuda
def test_runner_recaptures_for_a_new_shape_and_caps_the_shapes():
    region = _region(_elementwise, (8,), (8,))
    runner = CudaGraphRunner(region, 0, (False, False), max_shapes=2)
    for n in (8, 16, 8, 16):
        x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        torch.testing.assert_close(runner(x, y)[1], x * y)
    assert runner.stats()["shapes_captured"] == 2 and runner.stats()["eager_calls"] == 0
    x = torch.randn(32, device="cuda")
    torch.testing.assert_close(runner(x, x)[1], x * x)  # a third shape: eager, still right
    assert runner.stats()["eager_shapes"] == 1 and runner.stats()["shapes_captured"] == 2
    assert "ran eagerly (cap 2 shapes)" in runner.describe()
    strict = CudaGraphRunner(region, 0, (False, False), max_shapes=1, strict=True)
    strict(torch.randn(8, device="cuda"), torch.randn(8, device="cuda"))
    with pytest.raises(CudaGraphFallback, match="more than 1 input shapes"):
        strict(torch.randn(4, device="cuda"), torch.randn(4, device="cuda"))


@pytest.mark.cuda
def test_runner_rerecords_when_a_static_input_moves():
    region = _region(_elementwise, (8,), (8,))
    runner = CudaGraphRunner(region, 0, (False, True))
    x = torch.randn(8, device="cuda")
    runner(x, torch.ones(8, device="cuda"))
    w = torch.full((8,), 2.0, device="cuda")
    torch.testing.assert_close(runner(x, w)[1], 2 * x)
    assert runner.stats()["rerecords"] == 1


@pytest.mark.cuda
def test_a_0d_cpu_scalar_input_is_copied_in_not_baked_in():
    region = graph_with_values(lambda g, x, s: _call(g, aten.mul.Tensor, x, s), (4,), ())
    runner = CudaGraphRunner(region, 0, (False, False))
    x = torch.ones(4, device="cuda")
    for value in (2.0, 3.0):
        (out,) = runner(x, torch.tensor(value))
        torch.testing.assert_close(out, torch.full((4,), value, device="cuda"))
    assert runner.stats()["replays"] == 2


@pytest.mark.cuda
def test_output_overwrite_guard():
    region = _region(_elementwise, (8,), (8,))
    guarded = CudaGraphRunner(region, 0, (False, False), guard_outputs=(1,))
    x, y = torch.randn(8, device="cuda"), torch.randn(8, device="cuda")
    held = guarded(x, y)[1]
    with pytest.raises(CudaGraphOutputOverwritten, match="output 1 returned by the previous call"):
        guarded(x, y)
    del held
    guarded(x, y)

    # the pass's default: outputs that leave the graph are cloned, so a held one stays right
    gm = graph_with_values(_chain(6), (8,)).to("cuda")
    rewritten = replace_regions(fx.GraphModule(gm, __import__("copy").deepcopy(gm.graph)),
                         [(0, [f"op{i}" for i in range(6)])], set(), RunnerOptions())
    a = torch.randn(8, device="cuda")
    first = rewritten(a)
    expected = first.clone()
    rewritten(torch.randn(8, device="cuda"))
    torch.testing.assert_close(first, expected)


@pytest.mark.cuda
def test_optimize_inference_on_cuda_captures_and_reports_memory():
    model, inputs, _ = models.build("resnet18", 2, tiny=True, device="cuda")
    model.eval()
    optimized = fxdream.optimize(model, inputs, passes=[CudaGraphs(min_gain_us=ALWAYS)])
    (row,) = optimized.report.passes
    assert row.applied, row.reason
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(optimized(*inputs), model(*inputs), atol=1e-4, rtol=1e-4)
    found = runners(optimized)
    assert found and all(r.stats()["replays"] >= 3 and r.eager_reason is None for r in found)
    assert cuda_graph_memory_bytes(optimized) > 0


@pytest.mark.cuda
def test_training_step_equality_with_forward_and_backward_captured():
    from conftest import assert_same_training_step
    model, inputs, _ = models.build("mnist_convnet", 4, tiny=True, device="cuda")
    optimized = fxdream.optimize(model, inputs, passes=[CudaGraphs(min_gain_us=ALWAYS)], training=True)
    phases = {(r.phase, r.applied) for r in optimized.report.passes}
    assert phases == {("fw", True), ("bw", True)}, [r.reason for r in optimized.report.passes]
    for _ in range(2):  # replays, not only the capture
        assert assert_same_training_step(model, optimized, inputs) > 0
    assert all(r.stats()["replays"] >= 2 for r in runners(optimized))


# last: a failed capture must leave the device usable, but if it did not, only this test would tell
@pytest.mark.cuda
def test_a_capture_failure_runs_the_region_eagerly_with_the_reason():
    def build(g, x):  # .item() synchronises: it cannot be captured
        return (_call(g, aten._local_scalar_dense.default, _call(g, aten.sum.default, x, name="total")),)
    runner = CudaGraphRunner(graph_with_values(build, (4,)), 0, (False,))
    x = torch.tensor([0.0, 1.0, 0.0, 2.0], device="cuda")
    assert runner(x)[0] == 3.0
    assert runner.eager_reason.startswith("capture failed: ")
    assert runner(x)[0] == 3.0 and runner.stats()["eager_calls"] == 2
    torch.testing.assert_close((x + 1).cpu(), x.cpu() + 1)  # the device still works
