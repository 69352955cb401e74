"""cuda_graphs' rewrite and its runner: on CPU the runner runs each region eagerly (structure,
numerics, bookkeeping, fallbacks); tests marked cuda check capture and replay on a GPU.
"""

import operator

import pytest
import torch
import torch.fx as fx

import fxdream
from fxdream import models
from fxdream.passes.cuda_graphs.partition import RunnerOptions, partition, replace_regions
from fxdream.runtime.cuda_graph_runner import CudaGraphFallback, CudaGraphOutputOverwritten, CudaGraphRunner, clone_outputs, cuda_graph_memory_bytes, describe_runners, runners
from fxdream.pass_api import PassContext
from fxdream.passes.cuda_graphs import NEEDS_CUDA, CudaGraphs
from fxdream.passes.mark_incompatible import mark_incompatible
from fxdream.sim.graph_regions import cuda_graph_regions, inline_cuda_graph_runners
from conftest import graph_with_values
from cuda_graph_cases import ALWAYS, call, chain, names, split_by_syncs

aten = torch.ops.aten


# --- the rewrite (on CPU the runner runs the region eagerly) -----------------------------------

def test_rewrite_structure_and_numerics_and_which_outputs_are_cloned():
    def build(g, x, w):
        a = call(g, aten.mm.default, x, w, name="mm")
        b = call(g, aten.relu.default, a, name="relu")
        s = call(g, aten._local_scalar_dense.default, call(g, aten.sum.default, b, name="total"), name="item")
        c = call(g, aten.mul.Tensor, b, s, name="scale")  # marked: reads a host value
        d = call(g, aten.tanh.default, call(g, aten.add.Tensor, c, b, name="add"), name="tanh")
        return d, call(g, aten.t.default, b, name="bt")
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
    gm = graph_with_values(split_by_syncs, (8,))
    with pytest.raises(CudaGraphFallback, match="3 node\\(s\\) cannot be captured"):
        CudaGraphs(strict=True)(gm, PassContext(device="cpu"))


def test_views_of_graph_inputs_stay_outside_regions_and_weights_are_read_in_place():
    def build(g, x, w, b):  # a linear layer as aot writes it: t(w) then addmm
        t = call(g, aten.t.default, w, name="w_t")
        y = call(g, aten.addmm.default, b, x, t, name="addmm")
        return call(g, aten.relu.default, y, name="relu")
    gm = graph_with_values(build, (2, 4), (3, 4), (3,))
    regions = partition(gm, mark_incompatible(gm, PassContext()))
    assert names(regions) == [["addmm", "relu"]]
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
        r = call(g, aten.relu.default, x, name="relu")
        v = call(g, aten.slice.Tensor, r, 0, 1, 3, name="part")
        return v, call(g, aten.neg.default, r, name="neg")
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


def test_while_a_graph_is_timed_in_context_its_regions_run_as_they_are():
    """Timed in context, a graph runs on copies of its buffers: a capture there would hold the
    copies' addresses, and the first real call would capture every region again."""
    from fxdream.sim.profile.in_context import time_graph
    region = graph_with_values(_elementwise, (8,), (8,))
    runner = _SimulatedRunner(region, 0, (False, True))
    graph = fx.Graph()
    x, w = graph.placeholder("x"), graph.placeholder("w")
    out = graph.call_module("region", (x, w))
    graph.output(graph.call_function(torch.add, (graph.call_function(operator.getitem, (out, 0)), 1.0)))
    gm = fx.GraphModule(torch.nn.ModuleDict({"region": runner}), graph)
    inputs = [torch.randn(8), torch.randn(8)]
    assert time_graph(gm, inputs, torch.device("cpu"), {}, rounds=2, warmup=1) is not None
    stats = runner.stats()
    assert (stats["shapes_captured"], stats["replays"], stats["eager_calls"]) == (0, 0, 0)
    gm(*inputs)  # a real call captures, once
    assert runner.stats()["shapes_captured"] == 1 and runner.eager_reason is None


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
    return (call(g, aten.relu.default, call(g, aten.add.Tensor, x, y)),
            call(g, aten.mul.Tensor, x, y))


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
    region = graph_with_values(lambda g, x, s: call(g, aten.mul.Tensor, x, s), (4,), ())
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
    gm = graph_with_values(chain(6), (8,)).to("cuda")
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
        return (call(g, aten._local_scalar_dense.default, call(g, aten.sum.default, x, name="total")),)
    earlier = CudaGraphRunner(_region(_elementwise, (8,), (8,)), 0, (False, False))
    a, b = torch.randn(8, device="cuda"), torch.randn(8, device="cuda")
    earlier(a, b)
    runner = CudaGraphRunner(graph_with_values(build, (4,)), 0, (False,))
    x = torch.tensor([0.0, 1.0, 0.0, 2.0], device="cuda")
    assert runner(x)[0] == 3.0
    assert runner.eager_reason.startswith("capture failed: ")
    assert runner(x)[0] == 3.0 and runner.stats()["eager_calls"] == 2
    torch.testing.assert_close((x + 1).cpu(), x.cpu() + 1)  # the device still works
    # and so does its RNG (torch 2.11 left the generator "capturing": every random op raised)
    torch.manual_seed(0)
    first = torch.rand(4, device="cuda")
    torch.manual_seed(0)
    torch.testing.assert_close(torch.rand(4, device="cuda"), first)
    torch.nn.functional.dropout(torch.ones(16, device="cuda"), 0.5, training=True)
    torch.testing.assert_close(earlier(a, b)[1], a * b)  # a graph captured before still replays
