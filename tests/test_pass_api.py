import math

import pytest
import torch
import torch.nn as nn

import fxdream
from fxdream.ir.nodes import op_name
from fxdream.pass_api import PassContext, PassResult
from fxdream.pass_registry import available_passes, resolve_passes


class ScaledLinear(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return torch.relu(self.lin(x) * 1.0)


class FoldMulByOne:
    """x * 1.0 → x: the smallest useful rewrite."""
    name = "test_fold_mul_by_one"

    def applies_to(self, ctx):
        return None

    def __call__(self, gm, ctx):
        folded = 0
        for node in list(gm.graph.nodes):
            if op_name(node) == "aten.mul" and node.args[1] == 1.0:
                node.replace_all_uses_with(node.args[0])
                gm.graph.erase_node(node)
                folded += 1
        return PassResult(gm, folded > 0, f"folded {folded} x*1" if folded else "no x*1 found")


class Raises:
    name = "test_raises"

    def applies_to(self, ctx):
        return None

    def __call__(self, gm, ctx):
        raise RuntimeError("boom")


class BreaksTheGraph:
    name = "test_breaks_graph"

    def applies_to(self, ctx):
        return None

    def __call__(self, gm, ctx):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        ghost = torch.fx.Graph().placeholder("ghost")  # a node from another graph
        output.args = ((ghost,),)
        return PassResult(gm, True, "rewired the output")


def _fails_when_run(x):
    if x.shape[0] != RUNS_AT_BATCH:  # every call by default; a test lets the build's batch run
        raise RuntimeError("wrong strides for view")
    return torch.relu(x)


RUNS_AT_BATCH = -1


class FailsWhenRun:
    """A graph that lints and fake-runs, but whose rewrite raises when run (e.g. a view of a layout
    the rewrite changed)."""
    name = "test_fails_when_run"

    def applies_to(self, ctx):
        return None

    def __call__(self, gm, ctx):
        relu = next(n for n in gm.graph.nodes if op_name(n) == "aten.relu")
        relu.target = _fails_when_run
        gm.recompile()
        return PassResult(gm, True, "made relu raise")


class OnlyInTraining:
    name = "test_only_in_training"

    def applies_to(self, ctx):
        return None if ctx.training else "inference: nothing to do"

    def __call__(self, gm, ctx):
        return PassResult(gm, False, "looked, changed nothing")


def _run(passes, training=False, cost="analytic"):
    model, x = ScaledLinear(), torch.randn(4, 8)
    optimized = fxdream.optimize(model, (x,), passes=passes, training=training, cost=cost)
    return model, x, optimized


def test_a_pass_rewrites_and_its_delta_is_predicted_from_simulation():
    model, x, optimized = _run([FoldMulByOne()])
    (row,) = optimized.report.passes
    assert row.applied and row.reason == "folded 1 x*1" and row.phase == "fw"
    # one op fewer: its dispatch and kernel time disappear from the simulated graph
    assert row.predicted_delta_us < 0
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))


def test_pass_that_raises_is_skipped_and_reported():
    model, x, optimized = _run([Raises(), FoldMulByOne()])
    raised, folded = optimized.report.passes
    assert not raised.applied
    assert "skipped: the pass raised RuntimeError: boom" in raised.reason and "test_pass_api.py" in raised.reason
    assert folded.applied  # the next pass still runs on the unchanged graph
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))


class ReturnsNothing(Raises):
    name = "returns_nothing"

    def __call__(self, gm, ctx):
        gm.graph.eliminate_dead_code()  # the author forgot the return


def test_a_pass_returning_no_pass_result_is_skipped_with_what_it_must_return():
    model, x, optimized = _run([ReturnsNothing(), FoldMulByOne()])
    nothing, folded = optimized.report.passes
    assert not nothing.applied and nothing.reason == ("skipped: the pass returned NoneType, not a "
                                                      "PassResult(graph_module, modified, reason)")
    assert folded.applied


class SumsTheOutput(Raises):
    """A wrong pass: the graph returns its first output summed (0-d where eager's is [n, 4])."""
    name = "sums_the_output"

    def __call__(self, gm, ctx):
        output = gm.graph.output_node()
        first, *rest = output.args[0]
        with gm.graph.inserting_before(output):
            summed = gm.graph.call_function(torch.ops.aten.sum.default, (first,))
        output.args = ((summed, *rest),)
        gm.recompile()
        return PassResult(gm, True, "summed the output")


def test_verify_calls_an_output_of_another_shape_a_difference_not_a_rounding():
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), torch.randn(3, 8)
    report = fxdream.optimize(model, (x,), passes=[SumsTheOutput()], cost=None, verify=True).report
    assert report.verified_max_abs_diff == math.inf and report.verified_beyond_rounding
    assert any(n.startswith("an output's shape, or the number of outputs, differs from eager's") for n in report.notes)


def test_pass_that_breaks_the_graph_is_skipped():
    model, x, optimized = _run([BreaksTheGraph()])
    (row,) = optimized.report.passes
    assert not row.applied and row.reason.startswith("skipped: the pass raised")
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))


@pytest.mark.parametrize("training", [False, True])
def test_rewritten_graphs_that_fail_when_run_give_way_to_the_captured_ones(training):
    model, x, optimized = _run([FoldMulByOne(), FailsWhenRun()], training=training)
    report = optimized.report
    assert report.fallback_reason is None and report.graphs  # still captured: only the passes are dropped
    assert not any(row.applied for row in report.passes)
    assert all(row.reason.startswith("applied, but the rewritten graphs failed when run (RuntimeError: wrong "
                                     "strides for view") for row in report.passes if row.phase == "fw")
    assert optimized.rewritten_graphs == {}
    with torch.set_grad_enabled(training):
        torch.testing.assert_close(optimized(x), model(x))


@pytest.mark.parametrize("through", ["optimize", "torch.compile"])
def test_a_rewrite_that_raises_in_its_timed_run_is_skipped_at_build(through):
    # with measured costs the rewritten graph runs on the example before it is chosen: a broken
    # rewrite is skipped there, also where nothing else would catch it (the torch.compile backend)
    model, x = nn.ReLU(), torch.randn(4, 8)  # the relu made to raise is the whole graph: worth timing
    rows = []
    with torch.no_grad():
        if through == "optimize":
            optimized = fxdream.optimize(model, (x,), passes=[FailsWhenRun()], cost="profiled")
            rows, out = optimized.report.passes, optimized(x)
        else:
            compiled = torch.compile(model, backend="fxdream",
                                     options={"passes": [FailsWhenRun()], "cost": "profiled", "on_report": rows.append})
            out = compiled(x)
        torch.testing.assert_close(out, model(x))
    (row,) = rows
    assert not row.applied and row.reason == (
        "skipped: the rewritten graph raised when run on the example inputs, where the graph before it "
        "ran: RuntimeError: wrong strides for view")


def test_under_the_backend_a_rewrite_that_raises_untimed_gives_way_to_the_captured_graph():
    # no timed run at build (analytic costs): the first call finds the broken rewrite
    model, x, rows = ScaledLinear(), torch.randn(4, 8), []
    compiled = torch.compile(model, backend="fxdream",
                             options={"passes": [FailsWhenRun()], "cost": "analytic", "on_report": rows.append})
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x))
        torch.testing.assert_close(compiled(x), model(x))
    applied, failed = rows
    assert applied.applied and applied.reason == "made relu raise"
    assert not failed.applied and failed.reason == ("applied, but the rewritten graphs failed when run "
                                                    "(RuntimeError: wrong strides for view); the graph runs "
                                                    "as captured: made relu raise")


def test_a_rewritten_graph_that_fails_on_a_later_call_gives_way_to_the_captured_one(monkeypatch):
    monkeypatch.setitem(globals(), "RUNS_AT_BATCH", 4)  # the build's batch runs, a batch of 6 raises
    model, x, optimized = _run([FailsWhenRun()])
    assert optimized.report.fallback_reason is None and optimized.report.passes[0].applied
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))
        with pytest.raises(RuntimeError, match="mat1 and mat2 shapes cannot be multiplied"):
            optimized(torch.randn(6, 5))  # eager raises too: the caller's error, as eager says it
        x6 = torch.randn(6, 8)
        torch.testing.assert_close(optimized(x6), model(x6))  # batch 6's graph, rewritten, raised
        torch.testing.assert_close(optimized(x6), model(x6))
        torch.testing.assert_close(optimized(x), model(x))  # batch 4's rewritten graph still runs
    report = optimized.report
    assert report.fallback_reason is None
    first, later = (row for row in report.passes if row.graph_index in (0, 1))
    assert first.applied and first.graph_index == 0
    assert not later.applied and later.reason.startswith(
        "applied, but the rewritten graphs failed when run (RuntimeError: wrong strides for view); the graph "
        "runs as captured")
    assert list(optimized.rewritten_graphs) == [(0, "fw")]


def test_applies_to_reason_is_reported_per_graph():
    _, _, optimized = _run([OnlyInTraining()])
    assert [(r.applied, r.reason) for r in optimized.report.passes] == [(False, "inference: nothing to do")]
    _, _, trained = _run([OnlyInTraining()], training=True)
    assert [(r.phase, r.reason) for r in trained.report.passes] == [
        ("fw", "looked, changed nothing"), ("bw", "looked, changed nothing")]


def test_registered_pass_is_found_by_name():
    fxdream.register_pass(FoldMulByOne)
    assert "test_fold_mul_by_one" in available_passes()
    (resolved,) = resolve_passes(["test_fold_mul_by_one"])
    assert resolved.name == "test_fold_mul_by_one"
    with pytest.raises(TypeError, match="is not a pass"):
        fxdream.register_pass(object())


def test_no_cost_model_means_no_prediction():
    _, _, optimized = _run([FoldMulByOne()], cost=None)
    (row,) = optimized.report.passes
    assert row.applied and row.predicted_delta_us is None


def test_pass_context_is_frozen_in_inference_forward_only():
    assert PassContext(training=False, phase="fw").frozen
    assert not PassContext(training=True, phase="fw").frozen
    assert not PassContext(training=False, phase="bw").frozen


def test_auto_runs_the_rewriting_passes_before_those_that_schedule_kernels():
    """cuda_graphs marks regions of the final kernels: run before a fusion, its regions broke
    (the fusion's channels_last variant could not be predicted on a GPU)."""
    names = fxdream.pass_registry.available_passes()
    rewrites = [names.index(n) for n in ("fuse_conv_bias_act", "fuse_attention")]
    schedules = [names.index(n) for n in ("cuda_graphs", "aux_stream_backward")]
    assert max(rewrites) < min(schedules)
