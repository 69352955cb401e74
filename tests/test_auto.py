"""passes="auto": every subset simulated, the best predicted one applied (under a memory budget)."""
import dataclasses
import time

import pytest
import torch
import torch.nn as nn

import fxdream
from fxdream.build import cost_model_for
from fxdream.capturing.dynamo import compile_with
from fxdream.capturing.session import CaptureSession
from fxdream.capturing.steps import run_once
from fxdream.capturing.steps import seeded_step as pipeline_seeded_step
from fxdream.ir.nodes import op_name
from fxdream.pass_api import PassContext, PassResult
from fxdream.pass_runner import PassPipeline


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        return torch.relu(self.lin(x) * 1.0)


class FoldMulByOne:
    name = "fold"

    def applies_to(self, ctx):
        return None

    def __call__(self, gm, ctx):
        nodes = [n for n in gm.graph.nodes if op_name(n) == "aten.mul" and n.args[1] == 1.0]
        for n in nodes:
            n.replace_all_uses_with(n.args[0])
            gm.graph.erase_node(n)
        return PassResult(gm, bool(nodes), f"folded {len(nodes)}")


class AddCopies:
    """Makes the graph slower and hungrier: k extra clones kept alive to the output."""
    def __init__(self, name, copies):
        self.name, self.copies = name, copies

    def applies_to(self, ctx):
        return None

    def __call__(self, gm, ctx):
        output = next(n for n in gm.graph.nodes if n.op == "output")
        value = output.args[0][0]
        with gm.graph.inserting_before(output):
            clones = [gm.graph.call_function(torch.ops.aten.clone.default, (value,)) for _ in range(self.copies)]
            total = clones[0]
            for c in clones[1:]:
                total = gm.graph.call_function(torch.ops.aten.add.Tensor, (total, c))
            for n in clones + [total]:
                n.meta["val"] = value.meta["val"]
            zero = gm.graph.call_function(torch.ops.aten.mul.Tensor, (total, 0.0))
            zero.meta["val"] = value.meta["val"]
            result = gm.graph.call_function(torch.ops.aten.add.Tensor, (value, zero))
            result.meta["val"] = value.meta["val"]
        output.args = ((result,),)
        return PassResult(gm, True, f"added {self.copies} copies")


def _auto(passes, memory_budget=None):
    model, x = Net(), torch.randn(32, 64)
    model.eval()
    pipeline = PassPipeline(tuple(passes), PassContext(cost_model=cost_model_for("cpu", "analytic"),
                                                        memory_budget=memory_budget), auto=True)
    session = CaptureSession(model, transform=pipeline)
    out = run_once(compile_with(model, session), model, (x,), False)
    torch.testing.assert_close(out, model(x))
    return pipeline


def test_auto_keeps_the_helpful_pass_and_drops_the_harmful_one():
    pipeline = _auto([FoldMulByOne(), AddCopies("copies", 3)])
    auto = pipeline.rows[-1]
    assert auto.name == "auto" and auto.reason.startswith("chose fold: predicted")
    assert "of 4 subsets" in auto.reason
    assert [(r.name, r.applied) for r in pipeline.rows[:-1]] == [("fold", True), ("copies", False)]
    rejected = pipeline.rows[1]  # every pass has its row: what it did alone, and that it was not chosen
    assert rejected.reason == "not chosen: added 3 copies" and rejected.predicted_delta_us > 0
    assert "copies" in auto.notes[0] and "fold+copies" in auto.notes[0]


def test_auto_choosing_no_pass_still_says_what_each_did():
    pipeline = _auto([Counted("idle"), AddCopies("copies", 3)])
    assert pipeline.rows[-1].reason.startswith("chose none")
    assert [(r.name, r.applied, r.reason) for r in pipeline.rows[:-1]] == [
        ("idle", False, "nothing to do"), ("copies", False, "not chosen: added 3 copies")]


def test_a_row_re_timed_side_by_side_reads_the_new_times_beside_the_first_look():
    from fxdream.pass_rows import repredicted
    from fxdream.report import PassReport
    first_look = PassReport("p", 0, "fw", False, "not chosen: did it (predicted: 120.000 → 60.000 ms)",
                            predicted_delta_us=-60e3, predicted_delta_peak_bytes=0)
    row = repredicted(first_look, (100e3, 0), (60e3, 8))
    assert (row.predicted_delta_us, row.predicted_delta_peak_bytes) == (-40e3, 8)
    assert row.reason == ("not chosen: did it (predicted: 120.000 → 60.000 ms); "
                          "re-timed side by side: 100.000 → 60.000 ms")
    nearly = dataclasses.replace(first_look, predicted_delta_us=-20e3)  # moved by 0.5 % of the graph
    assert repredicted(nearly, (100e3, 0), (80.5e3, 0)).reason == first_look.reason


class Counted:
    """Leaves the graph as it is and counts its runs."""
    def __init__(self, name):
        self.name, self.runs = name, 0

    def applies_to(self, ctx):
        return None

    def __call__(self, gm, ctx):
        self.runs += 1
        return PassResult(gm, False, "nothing to do")


def test_a_pass_is_not_run_again_on_a_graph_another_subset_left_as_it_was():
    first, last = Counted("a"), Counted("c")
    pipeline = _auto([first, FoldMulByOne(), last])
    assert "of 8 subsets" in pipeline.rows[-1].reason
    # c: once on the captured graph, once on the folded one (4 runs without the reuse)
    assert (first.runs, last.runs) == (1, 2)


class Final:
    """A ``final`` pass: run once on the chosen subset's graph, kept only if predicted faster."""
    final = True

    def __init__(self, inner):
        self.inner, self.name = inner, inner.name

    def applies_to(self, ctx):
        return None

    def __call__(self, gm, ctx):
        return self.inner(gm, ctx)


def test_a_final_pass_runs_once_on_the_chosen_graph_and_stays_if_predicted_faster():
    idle = Counted("counted")
    pipeline = _auto([AddCopies("copies", 2), Final(FoldMulByOne()), Final(idle)])
    auto, fold, counted = pipeline.rows[-3:]
    assert auto.name == "auto" and auto.reason.startswith("chose none") and "of 2 subsets" in auto.reason
    assert auto.reason.endswith("; then, on the chosen graph, fold, counted")  # "none" is of the subsets
    assert (fold.name, fold.applied, fold.reason) == ("fold", True, "folded 1")
    assert fold.predicted_delta_us < 0 and idle.runs == 1 and not counted.applied
    assert not any(op_name(n) == "aten.mul" for n in pipeline.rewritten[(0, "fw")].graph.nodes)


def test_a_final_pass_predicted_no_faster_is_not_kept():
    pipeline = _auto([Final(AddCopies("copies", 2))])
    row = pipeline.rows[-1]
    assert (row.name, row.applied) == ("copies", False)
    assert row.reason == "not kept, predicted no faster: added 2 copies" and row.predicted_delta_us > 0
    assert not any(op_name(n) == "aten.clone" for n in pipeline.rewritten[(0, "fw")].graph.nodes)


class Alone(Counted):
    """An ``alone`` pass: compared by auto as an alternative of its own, on the captured graph."""
    alone = True

    def __init__(self, inner):
        super().__init__(inner.name)
        self.inner, self.graphs = inner, []

    def __call__(self, gm, ctx):
        self.runs += 1
        self.graphs.append([op_name(n) for n in gm.graph.nodes if n.op == "call_function"])
        return self.inner(gm, ctx)


def test_an_alone_pass_runs_once_on_the_captured_graph_and_is_chosen_against_the_subsets():
    alone = Alone(FoldMulByOne())
    pipeline = _auto([AddCopies("copies", 3), alone])
    auto = pipeline.rows[-1]
    assert auto.reason.startswith("chose fold: predicted") and "of 3 subsets" in auto.reason
    assert alone.runs == 1 and "aten.clone" not in alone.graphs[0]  # never after another pass
    assert "copies+fold" not in auto.notes[0] and "fold+copies" not in auto.notes[0]
    assert not any(op_name(n) == "aten.mul" for n in pipeline.rewritten[(0, "fw")].graph.nodes)


def test_auto_respects_the_memory_budget():
    unbounded = _auto([AddCopies("copies", 2)])
    assert unbounded.rows[-1].reason.startswith("chose none")
    # a budget below the unrewritten graph's peak: every subset is over it, the lowest peak is kept
    tight = _auto([AddCopies("copies", 2)], memory_budget=1)
    assert tight.rows[-1].reason.startswith("chose none")
    assert tight.rows[-1].reason.endswith("(none fits memory_budget: the lowest predicted peak)")
    assert "(over budget)" in tight.rows[-1].notes[0]


def test_over_every_budget_the_lowest_peak_wins_over_speed(monkeypatch):
    def predicted(self, gm, phase):  # pretend the copies save time, and cost 1 MB
        copies = any(op_name(n) == "aten.clone" for n in gm.graph.nodes)
        return 100.0 - 20.0 * copies, 1000 + 10**6 * copies
    monkeypatch.setattr(PassPipeline, "predict", predicted)
    assert _auto([AddCopies("copies", 2)]).rows[-1].reason.startswith("chose copies")
    tight = _auto([AddCopies("copies", 2)], memory_budget=1)
    assert tight.rows[-1].reason == ("chose none: predicted 0.100 ms of 2 subsets "
                                     "(none fits memory_budget: the lowest predicted peak)")


def test_auto_is_not_forced_and_named_passes_are():
    seen = []

    class Spy:
        name = "spy"

        def applies_to(self, ctx):
            seen.append(ctx.forced)
            return "just looking"

        def __call__(self, gm, ctx):
            raise AssertionError("not applicable")

    _auto([Spy()])
    model, x = Net(), torch.randn(4, 64)
    fxdream.optimize(model, (x,), passes=[Spy()], cost=None)
    assert seen == [False, True]


def test_optimize_verify_and_measure_fill_the_report():
    model, x = Net(), torch.randn(8, 64)
    model.eval()
    optimized = fxdream.optimize(model, (x,), passes=[FoldMulByOne()], cost="analytic", verify=True, measure=True)
    report = optimized.report
    assert report.verified_max_abs_diff == 0.0
    assert report.predicted_optimized_ms < report.predicted_baseline_ms
    assert report.measured_baseline_ms > 0 and report.measured_optimized_ms > 0
    assert report.top_layers and report.top_layers[0][0] == "lin"
    text = report.to_markdown()
    assert "Predicted:" in text and "Measured:" in text and "Verified against eager" in text


def _timed(eager_ms, built_ms):
    from fxdream.measure import Measurement

    def fake_time_interleaved(runners, **kwargs):
        for run in runners.values():
            run()  # the runners work (the built module runs its graphs)
        return {"eager": Measurement(eager_ms, eager_ms, eager_ms, 1, 1),
                "built": Measurement(built_ms, built_ms, built_ms, 1, 1)}
    return fake_time_interleaved


def test_auto_runs_eagerly_when_the_built_module_is_measured_slower(monkeypatch):
    import fxdream.eager_check as pipeline
    monkeypatch.setattr(pipeline, "time_interleaved", _timed(eager_ms=1.0, built_ms=1.2))
    model, x = Net().eval(), torch.randn(8, 64)
    optimized = fxdream.optimize(model, (x,), passes="auto")
    report = optimized.report
    assert report.ran_eagerly and report.fallback_reason.startswith(
        "measured slower than eager (1.200 vs 1.000 ms per call)")
    assert (report.measured_eager_ms, report.measured_built_ms) == (1.0, 1.2)
    assert report.predicted_optimized_ms is not None  # the predictions stay in the report
    assert "Timed against eager: 1.000 ms eager, 1.200 ms built (+20.0 %; runs eagerly)" in report.to_markdown()
    with torch.no_grad():
        assert torch.equal(optimized(x), model(x))


class CountsCalls(nn.Module):
    """A Python int the forward increments: dynamo guards on it and compiles every call again."""
    def __init__(self):
        super().__init__()
        self.lin, self.calls = nn.Linear(64, 8), 0

    def forward(self, x, **unused):  # **unused: the dynamo path
        self.calls += 1
        return self.lin(x)


def test_the_eager_check_line_blames_itself_only_for_its_own_fallback(monkeypatch):
    import fxdream.eager_check as pipeline
    monkeypatch.setattr(pipeline, "time_interleaved", _timed(eager_ms=1.0, built_ms=0.9))  # the check keeps them
    model, x = CountsCalls().eval(), torch.randn(8, 64)
    optimized = fxdream.optimize(model, (x,), passes="auto")
    for _ in range(6):
        with torch.no_grad():
            optimized(x)  # recompiles every call: runs eagerly after a few
    report = optimized.report
    assert report.ran_eagerly and "compiled calls with the same input shapes" in report.fallback_reason
    assert not report.ran_eagerly_as_measured_slower
    assert "Timed against eager: 1.000 ms eager, 0.900 ms built (-10.0 %)." in report.to_markdown()


def test_auto_keeps_the_graphs_when_they_are_not_slower_and_the_check_can_be_off(monkeypatch):
    import fxdream.eager_check as pipeline
    monkeypatch.setattr(pipeline, "time_interleaved", _timed(eager_ms=1.0, built_ms=1.04))  # within 5 %
    model, x = Net().eval(), torch.randn(8, 64)
    kept = fxdream.optimize(model, (x,), passes="auto")
    assert not kept.report.ran_eagerly and kept.report.measured_built_ms == 1.04
    monkeypatch.setattr(pipeline, "time_interleaved", _timed(eager_ms=1.0, built_ms=9.0))
    for unchecked in (fxdream.optimize(model, (x,), passes="auto", eager_check=False),
                      fxdream.optimize(model, (x,), passes=[FoldMulByOne()]),  # named passes: forced
                      fxdream.optimize(model, (x,), passes="auto", cost="analytic"),  # nothing measured
                      fxdream.optimize(model, (x,), passes="auto", strict=True)):  # the graphs, always
        assert not unchecked.report.ran_eagerly and unchecked.report.measured_eager_ms is None
    monkeypatch.setattr(pipeline, "EAGER_CHECK_MAX_CALL_MS", 0.0)  # a long call: not checked
    assert fxdream.optimize(model, (x,), passes="auto").report.measured_eager_ms is None
    with pytest.raises(TypeError, match="eager_check must be True or False"):
        fxdream.optimize(model, (x,), eager_check="yes")


def test_eager_check_on_a_long_call_says_it_did_not_time(monkeypatch):
    import fxdream.eager_check as pipeline
    # the graphs' ops: ~0.03 ms predicted here (12 ms on a loaded machine), far under 2x the limit
    monkeypatch.setattr(pipeline, "EAGER_CHECK_MAX_CALL_MS", 40.0)
    model, calls = Net().eval(), []

    def seeded_step(m, *args, **kwargs):  # an eager call of ≥ 250 ms, over 5x the limit
        step = pipeline_seeded_step(m, *args, **kwargs)

        def counted():
            calls.append(m)
            if m is model:
                time.sleep(0.25)
            return step()
        return counted
    monkeypatch.setattr(pipeline, "seeded_step", seeded_step)
    optimized = fxdream.optimize(model, (torch.randn(8, 64),), passes="auto", eager_check=True)
    report = optimized.report
    assert report.measured_eager_ms is None and not report.ran_eagerly
    assert any(n.startswith("not timed against eager: an eager call takes") for n in report.notes), report.notes
    assert calls.count(model) == 1  # over 5x the limit, the first call is not timed again


def test_eager_check_skips_eager_calls_where_the_graphs_alone_predict_a_long_call(monkeypatch):
    import fxdream.eager_check as pipeline
    model, calls = Net().eval(), []
    def seeded_step(m, *args, **kwargs):
        step = pipeline_seeded_step(m, *args, **kwargs)
        return lambda: calls.append(m) or step()
    monkeypatch.setattr(pipeline, "seeded_step", seeded_step)
    predicted = fxdream.optimize(model, (torch.randn(8, 64),), passes="auto").report.predicted_baseline_ms
    # predicted: 100x the limit, so that a rebuild's prediction (its own measurements, on a machine
    # as busy as it happens to be) is still over 2x
    monkeypatch.setattr(pipeline, "EAGER_CHECK_MAX_CALL_MS", predicted / 100)
    calls.clear()
    report = fxdream.optimize(model, (torch.randn(8, 64),), passes="auto").report
    assert report.measured_eager_ms is None and not report.ran_eagerly
    assert any(n.startswith("not timed against eager: the captured graphs' ops alone take") for n in report.notes)
    assert model not in calls  # not one eager call
    monkeypatch.setattr(pipeline, "EAGER_CHECK_MAX_CALL_MS", 1e9)  # predicted far under the limit: timed
    assert fxdream.optimize(model, (torch.randn(8, 64),), passes="auto").report.measured_eager_ms is not None
