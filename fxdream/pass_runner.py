"""Running passes on one captured graph: in order, or choosing the best subset ("auto").

Every pass runs on a copy, then ``graph.lint()``; a pass that raises or breaks the graph is
skipped and reported, never fatal. Its predicted effect is derived, never hand-written:
simulate(lower(after)) - simulate(lower(before)) with the pipeline's cost model. With a
Profiled cost model the graph is first timed in context, on its real inputs.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import traceback
from typing import Callable

import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule  # private: GraphModule with code on demand

from fxdream.capturing.dynamo import describe_error
from fxdream.ir.graphs import copy_graph_module
from fxdream.pass_api import Pass, PassContext, PassResult, complete_new_nodes
from fxdream.pass_rows import not_run, repredicted, rows_not_chosen
from fxdream.report import PassReport
from fxdream.runtime.direct_calls import call_ops_directly
from fxdream.sim.cost.profiled import Profiled
from fxdream.sim.cost.spread import SpreadBound
from fxdream.sim.prediction import graph_prediction, step_prediction
from fxdream.sim.profile.in_context import graph_fingerprint

log = logging.getLogger("fxdream")
MAX_EXHAUSTIVE = 5  # up to 2**5 subsets are simulated; beyond that, greedy
# A candidate's first two timed runs both this much over the best prediction for its graph so
# far: no third run. Not one run: a graph's first run can be cold (a quarter slower than the next
# ones), and either run can be a noise spike (see ``in_context.time_graph``).
GIVE_UP_SLOWER_THAN = 1.25
# A simpler candidate ties with the fastest only within this share of it (and within its spread)
TIE_MAX_GAIN = 0.05
# Candidates predicted within this share of the fastest are timed again side by side with it and
# the graph as captured (``Profiled.profile_side_by_side``) before the choice; slower ones cannot win.
SIDE_BY_SIDE_MARGIN = 0.25
SIDE_BY_SIDE_NEW_SHARE = 0.05  # ... unless its ops not in the graphs timed with it are less of its time
# Under passes="auto" the side-by-side rounds time the contenders again, so the first look at a
# graph (the capture's, each candidate's) whose run takes longer than this (seconds) is one
# round: a second would cost a whole run of build time for samples those rounds replace. Past a
# tenth of a second a first round's one-time costs (oneDNN primitives made) are a small share of it.
FIRST_LOOK_ONE_ROUND_S = 0.1


class RewriteFailed(RuntimeError):
    """A pass's rewritten graph raised when run on real inputs the graph before it ran on."""


def compiled(gm: fx.GraphModule) -> fx.GraphModule:
    """``gm`` with its code generated now (a copy's: ops called directly, ``direct_calls``),
    so a bound ``gm.forward`` is the generated one."""
    _LazyGraphModule.force_recompile(call_ops_directly(gm, recompile=False))
    return gm


class PassPipeline:
    """The transform a CaptureSession applies to each forward/backward graph."""

    def __init__(self, passes: tuple[Pass, ...], base_context: PassContext, auto: bool = False,
                 on_row: Callable[[PassReport], None] | None = None):
        # a pass that changes numerics (bf16) runs first, forced, on every graph; the rest (named,
        # or auto's subsets) rewrite what it made
        self.leading = tuple(p for p in passes if getattr(p, "changes_numerics", False))
        self.passes = tuple(p for p in passes if p not in self.leading)
        self.base_context = base_context
        self.auto = auto
        self.on_row = on_row
        self.rows: list[PassReport] = []
        self.rewritten: dict[tuple[int, str], fx.GraphModule] = {}  # (subgraph, phase) → graph run
        self._inputs: dict[tuple[int, str], object] = {}  # real inputs per graph, for profiling
        self._predictions: dict[int, tuple[fx.GraphModule, tuple[float, int]]] = {}
        self._by_nodes: dict[tuple, tuple[float, int]] = {}  # (graph_fingerprint, phase) → prediction, per graph
        self._costs_revision = 0  # the cost model's revision the memoized predictions were made at
        self._best_us: dict[tuple[int, str], float] = {}  # (subgraph, phase) → best candidate predicted
        self._ran_alone: set[tuple[int, str]] = set()  # graphs that ran on their real inputs (or did before)
        self._timed_now: set[tuple[int, str]] = set()  # graphs this build timed as captured (not a rebuild)
        self._step_forward: fx.GraphModule | None = None  # the backward being run's forward, on a GPU

    # --- predictions -------------------------------------------------------------------------
    def predict(self, gm: fx.GraphModule, phase: str) -> tuple[float, int] | None:
        """(µs, peak bytes) of one graph, memoized per graph object and per its nodes: a pass that
        keeps a copy of its input to compare against (prepack_linear, fuse_attention) asks for a
        graph predicted already (lowering and simulating a large graph costs the build tens of ms).
        A cost that changed since (a candidate's new ops timed in context after another candidate
        shared them timed alone) makes every memoized prediction stale: before and after a rewrite
        must be predicted with the same costs."""
        cost = self.base_context.cost_model
        if cost is None:
            return None
        revision = getattr(cost, "revision", 0)
        if revision != self._costs_revision:
            self._predictions.clear()
            self._by_nodes.clear()
            self._costs_revision = revision
        cached = self._predictions.get(id(gm))
        if cached is None or cached[0] is not gm:
            key = (graph_fingerprint(gm), phase)
            if key not in self._by_nodes:
                self._by_nodes[key] = self._graph_prediction(gm, cost, phase)
            cached = (gm, self._by_nodes[key])
            self._predictions[id(gm)] = cached
        return cached[1]

    def _graph_prediction(self, gm: fx.GraphModule, cost, phase: str) -> tuple[float, int]:
        """One graph's prediction; a backward on a GPU in its step, after its forward
        (``step_prediction``): its candidates differ as the whole steps do."""
        if phase == "bw":
            return step_prediction(self._step_forward, gm, cost)
        return graph_prediction(gm, cost, phase)

    def _profile(self, gm: fx.GraphModule, phase: str, index: int, inputs) -> None:
        """Time the graph's nodes on their real inputs, unless every one was timed in context
        before (an earlier build: ``sim.profile_store``); keep the inputs to time candidates."""
        cost = self.base_context.cost_model
        if not isinstance(cost, Profiled):
            return
        if phase == "fw" and inputs:
            self._inputs[(index, "fw")] = inputs
            if not cost.measured_in_context(gm):
                values = cost.profile_graph(gm, inputs, one_round_above_s=self._first_look_s())
                self._timed_now.add((index, "fw"))
            else:  # the backward's saved tensors, only if a backward candidate needs them
                values = lambda: cost.run_graph(gm, inputs)  # noqa: E731
            if values is not None:
                self._ran_alone.add((index, "fw"))
            if values is not None and self.base_context.training:
                self._inputs[(index, "bw")] = values  # the backward's saved tensors, by name
        elif phase == "bw" and (index, "bw") in self._inputs:
            fw_values = self._inputs[(index, "bw")]

            def backward_inputs():
                values = fw_values() if callable(fw_values) else fw_values
                return None if values is None else cost.backward_inputs(gm, values)
            self._inputs[(index, "bw")] = backward_inputs
            if not cost.measured_in_context(gm) and self._real_inputs(index, "bw") is not None:
                self._timed_now.add((index, "bw"))
                if cost.profile_graph(gm, self._real_inputs(index, "bw"),
                                      one_round_above_s=self._first_look_s()) is not None:
                    self._ran_alone.add((index, "bw"))
            elif cost.measured_in_context(gm):
                self._ran_alone.add((index, "bw"))

    def _first_look_s(self) -> float:
        """Seconds past which one timed round of a graph will do: under ``auto``, where the
        side-by-side rounds time the contenders again (``_time_side_by_side``)."""
        return FIRST_LOOK_ONE_ROUND_S if self.auto else math.inf

    def _real_inputs(self, index: int, phase: str):
        """The graph's real inputs, computed now if they were left for later (None if unknown)."""
        inputs = self._inputs.get((index, phase))
        if callable(inputs):
            inputs = self._inputs[(index, phase)] = inputs()
        return inputs

    def _profile_candidate(self, gm: fx.GraphModule, phase: str, index: int) -> None:
        """A rewrite's new ops are timed in context too, so before and after compare alike
        (unless they are a tiny share of the graph: ``Profiled.worth_timing_in_context``).
        A candidate whose first two timed runs are both ``GIVE_UP_SLOWER_THAN`` times the best
        prediction so far for its graph is not run a third time: a variant that slow cannot win,
        and a third run would only confirm it.

        A candidate that raises on the inputs the graph before it ran on raises ``RewriteFailed``:
        its rewrite is broken (a 1-d conv's output left in a layout GroupNorm's CPU kernel rejects
        passed every check but running it), and the pass is skipped with the reason; under
        ``torch.compile(backend="fxdream")`` nothing else would catch it before the user's call."""
        cost = self.base_context.cost_model
        if isinstance(cost, Profiled) and cost.to_time_in_context(gm):
            inputs = self._real_inputs(index, phase)
            if inputs is not None:
                best = self._best_us.get((index, phase), math.inf)
                try:
                    cost.profile_graph(gm, inputs, new_keys_only=True, give_up_above_us=GIVE_UP_SLOWER_THAN * best,
                                       raise_errors=(index, phase) in self._ran_alone,
                                       one_round_above_s=self._first_look_s(), one_round_under_us=best)
                except Exception as error:
                    raise RewriteFailed(f"the rewritten graph raised when run on the example inputs, where the "
                                        f"graph before it ran: {describe_error(error)}") from error

    # --- the transform -----------------------------------------------------------------------
    def __call__(self, gm: fx.GraphModule, phase: str, index: int, params: dict, inputs=None) -> fx.GraphModule:
        self._profile(gm, phase, index, inputs)
        predict_us = None
        if self.base_context.cost_model is not None:
            def predict_us(candidate: fx.GraphModule) -> float:
                self._profile_candidate(candidate, phase, index)  # a pass's choice rests on in-context times
                us = self.predict(candidate, phase)[0]
                self._best_us[(index, phase)] = min(us, self._best_us.get((index, phase), math.inf))
                return us
        forward = self.rewritten.get((index, "fw")) if phase == "bw" else None
        cost = self.base_context.cost_model
        self._step_forward = forward if getattr(getattr(cost, "device", None), "kind", None) == "cuda" else None
        ctx = dataclasses.replace(self.base_context, phase=phase, params=params, predict_us=predict_us,
                                  forced=not self.auto, forward=forward)
        for p in self.leading:
            gm, row = self._run_one(p, gm, dataclasses.replace(ctx, forced=True), index)
            self._add(row)
        if self.auto and ctx.cost_model is not None:
            gm = self._best_subset(gm, ctx, index)
        else:
            for p in self.passes:
                gm, row = self._run_one(p, gm, ctx, index)
                self._add(row)
        self.rewritten[(index, phase)] = gm = compiled(gm)
        self._by_nodes.clear()  # a graph's candidates are not another graph's
        self._step_forward = None
        if phase == "bw" or not self.base_context.training:  # done with this subgraph: let its tensors go
            self._inputs.pop((index, "fw"), None)
            self._inputs.pop((index, "bw"), None)
        return gm

    def _run_one(self, p: Pass, gm: fx.GraphModule, ctx: PassContext, index: int) -> tuple[fx.GraphModule, PassReport]:
        not_applicable = p.applies_to(ctx)
        if not_applicable is not None:
            return gm, PassReport(p.name, index, ctx.phase, False, not_applicable)
        try:
            result: PassResult = p(copy_graph_module(gm), ctx)
            if not isinstance(result, PassResult):
                return gm, PassReport(p.name, index, ctx.phase, False, f"skipped: the pass returned "
                                      f"{type(result).__name__}, not a PassResult(graph_module, modified, reason)")
            result.graph_module.graph.lint()
            result.graph_module.recompile()
        except Exception as error:  # a broken pass must never break the model
            where = traceback.extract_tb(error.__traceback__)[-1]
            reason = (f"skipped: the pass raised {type(error).__name__}: {error} "
                      f"({where.filename.rsplit('/', 1)[-1]}:{where.lineno})")
            return gm, PassReport(p.name, index, ctx.phase, False, reason)
        missing = complete_new_nodes(gm, result.graph_module) if result.modified else []
        if missing:  # such a node would be costed as free: the prediction would be wrong
            shown = "; ".join(missing[:3]) + (f"; and {len(missing) - 3} more" if len(missing) > 3 else "")
            return gm, PassReport(p.name, index, ctx.phase, False,
                                  f"skipped: the rewrite added {len(missing)} node(s) the simulator cannot cost "
                                  f"({shown}); set meta['val'] (a fake tensor) on new nodes")
        delta_us = delta_peak = None
        if result.modified and ctx.cost_model is not None:
            try:
                self._profile_candidate(result.graph_module, ctx.phase, index)
            except RewriteFailed as error:
                return gm, PassReport(p.name, index, ctx.phase, False, f"skipped: {error}")
            (before_us, before_peak), (after_us, after_peak) = (self.predict(gm, ctx.phase),
                                                                self.predict(result.graph_module, ctx.phase))
            delta_us, delta_peak = after_us - before_us, after_peak - before_peak
        row = PassReport(p.name, index, ctx.phase, result.modified, result.reason, result.notes,
                         predicted_delta_us=delta_us, predicted_delta_peak_bytes=delta_peak)
        return (result.graph_module if result.modified else gm), row

    def _best_subset(self, gm: fx.GraphModule, ctx: PassContext, index: int) -> fx.GraphModule:
        """Simulate every subset of the applicable passes (greedy beyond MAX_EXHAUSTIVE) and each
        ``alone`` pass on the graph as captured; keep the best.

        A subset whose predicted peak memory exceeds ``ctx.memory_budget`` is not a candidate;
        where every subset does, the one with the lowest predicted peak is kept.
        """
        applicable, final, alone, rows = [], [], [], []
        for p in self.passes:
            reason = p.applies_to(ctx)
            if reason is not None:
                rows.append(PassReport(p.name, index, ctx.phase, False, reason))
            else:
                kind = final if getattr(p, "final", False) else alone if getattr(p, "alone", False) else applicable
                kind.append(p)
        candidates = {(): (gm, [])}
        if len(applicable) <= MAX_EXHAUSTIVE:
            runs = {}  # (pass, graph it ran on): a pass that left a subset's graph as it was
            for size in range(1, len(applicable) + 1):  # is not run again on the same graph
                for subset in itertools.combinations(applicable, size):
                    base_gm, base_rows = candidates[subset[:-1]]
                    key = (id(subset[-1]), id(base_gm))
                    if key not in runs:
                        runs[key] = (base_gm, self._run_one(subset[-1], base_gm, ctx, index))
                    new_gm, row = runs[key][1]
                    candidates[subset] = (new_gm, base_rows + [row])
        else:
            chosen: tuple = ()
            for p in applicable:
                trial_gm, row = self._run_one(p, candidates[chosen][0], ctx, index)
                candidates[chosen + (p,)] = (trial_gm, candidates[chosen][1] + [row])
                if self.predict(trial_gm, ctx.phase)[0] < self.predict(candidates[chosen][0], ctx.phase)[0]:
                    chosen = chosen + (p,)
        for p in alone:  # an alternative to the others' rewrites: on the graph as captured only
            alternative_gm, row = self._run_one(p, gm, ctx, index)
            candidates[(p,)] = (alternative_gm, [row])
        if isinstance(ctx.cost_model, Profiled):
            self._time_side_by_side(self._contenders(candidates, ctx.phase), ctx.phase, index)
        scored = []
        for subset, (candidate, subset_rows) in candidates.items():
            us, peak = self.predict(candidate, ctx.phase)
            within = ctx.memory_budget is None or peak <= ctx.memory_budget
            # over the budget: the lowest peak first (the budget asks for memory before speed)
            scored.append((not within, 0 if within else peak, us, len(subset), subset, candidate, subset_rows))
        scored.sort(key=lambda item: item[:4])
        scored, tied = self._simplest_of_ties(scored, ctx.phase)
        over, _, best_us, _, best, best_gm, best_rows = scored[0]
        names = lambda subset: "+".join(p.name for p in subset) or "none"  # noqa: E731
        summary = "; ".join(f"{names(s[4])} {s[2] / 1e3:.3f} ms" + (" (over budget)" if s[0] else "")
                            for s in scored)
        best_rows = [self._repredicted(row, candidates[best[:k]][0], candidates[best[:k + 1]][0], ctx.phase)
                     for k, row in enumerate(best_rows)]
        not_chosen = [self._repredicted(row, candidates[subset[:-1]][0], candidates[subset][0], ctx.phase)
                      for row, subset in rows_not_chosen(candidates, best)]
        for row in rows + best_rows + not_chosen:
            self._add(row)
        over_budget = " (none fits memory_budget: the lowest predicted peak)" if over else ""
        ties = (f"; it ties with the fastest, {names(tied[4])} at {tied[2] / 1e3:.3f} ms (within that one's "
                f"measured spread and {TIE_MAX_GAIN:.0%}): the simpler is kept") if tied else ""
        then = f"; then, on the chosen graph, {', '.join(p.name for p in final)}" if final else ""
        self._add(PassReport("auto", index, ctx.phase, bool(best), f"chose {names(best)}: predicted "
                             f"{best_us / 1e3:.3f} ms of {len(scored)} subsets{over_budget}{ties}{then}",
                             notes=(f"predicted: {summary}",)))
        for p in final:
            best_gm = self._finish(p, best_gm, ctx, index)
        return best_gm

    def _repredicted(self, row: PassReport, before: fx.GraphModule, after: fx.GraphModule,
                     phase: str) -> PassReport:
        """``row`` predicted again from the costs as they are now (``pass_rows.repredicted``)."""
        if row.predicted_delta_us is None or before is after:
            return row
        return repredicted(row, self.predict(before, phase), self.predict(after, phase))

    def _contenders(self, candidates: dict, phase: str) -> list[fx.GraphModule]:
        """The graph as captured, then, fastest first, each candidate within ``SIDE_BY_SIDE_MARGIN``
        of the fastest whose ops not in the graphs chosen before are ``SIDE_BY_SIDE_NEW_SHARE`` of
        its time or more: one that differs from them by a packed linear layer, say, adds a whole
        run per round to tell what its one op's samples tell already."""
        cost = self.base_context.cost_model
        predicted = sorted((self.predict(graph, phase)[0], len(subset), order, graph)
                           for order, (subset, (graph, _)) in enumerate(candidates.items()))
        chosen = [candidates[()][0]]
        covered = set(cost.keys_of(chosen[0]))
        for us, _, _, graph in predicted:
            if us <= predicted[0][0] * (1 + SIDE_BY_SIDE_MARGIN) and \
                    cost.share_outside(graph, covered) >= SIDE_BY_SIDE_NEW_SHARE:
                chosen.append(graph)
                covered.update(cost.keys_of(graph))
        return chosen

    def _time_side_by_side(self, graphs: list[fx.GraphModule], phase: str, index: int) -> None:
        """Re-time ``graphs`` in the same interleaved rounds (``Profiled.profile_side_by_side``)
        so that their predictions compare like with like, and each gets the spread of its whole
        runs (its prediction's range); predictions made before are dropped.
        Not where this build did not time the graph as captured: a rebuild predicts from the
        costs an earlier build measured, as that build predicted."""
        cost = self.base_context.cost_model
        if not isinstance(cost, Profiled) or (index, phase) not in self._timed_now:
            return
        inputs = self._real_inputs(index, phase)
        if inputs is None:
            return
        if cost.profile_side_by_side([(graph, inputs) for graph in graphs]):
            self._by_nodes.clear()
            self._predictions.clear()

    def _simplest_of_ties(self, scored: list, phase: str) -> tuple[list, tuple | None]:
        """Candidates predicted within the measured spread of the fastest (the high end of its
        range, ``SpreadBound``) and within ``TIE_MAX_GAIN`` of it are ties: the
        one with the fewest passes first (a larger predicted gain is not given up to noise: on a
        busy machine the spread is wide). Returns the candidates reordered, and the fastest where
        a simpler tie displaced it."""
        cost = self.base_context.cost_model
        best = scored[0]
        if not isinstance(cost, Profiled) or best[0] or not best[4]:
            return scored, None
        high_us = min(self._graph_prediction(best[5], SpreadBound(cost, "high"), phase)[0],
                      best[2] * (1 + TIE_MAX_GAIN))
        ties = [s for s in scored if not s[0] and s[2] <= high_us]
        simplest = min(ties, key=lambda s: (len(s[4]), s[2]))
        if simplest is best:
            return scored, None
        return [simplest] + [s for s in scored if s is not simplest], best

    def _finish(self, p: Pass, gm: fx.GraphModule, ctx: PassContext, index: int) -> fx.GraphModule:
        """A ``final`` pass (a clean-up that helps whichever graph it gets, as ``reinplace``) runs
        once on the chosen graph, not in every subset (which would double them), and is kept
        only if the graph is then predicted faster."""
        trial, row = self._run_one(p, gm, ctx, index)
        if row.applied and row.predicted_delta_us is not None and row.predicted_delta_us >= 0:
            self._add(dataclasses.replace(row, applied=False, reason=f"not kept, predicted no faster: {row.reason}"))
            return gm
        self._add(row)
        return trial

    def rewrite_failed(self, index: int, phase: str, error: Exception) -> None:
        """Graph ``index``'s rewrite raised when run where the graph as captured did not: that
        graph runs as captured from now on (``graph_guards.captured_if_rewrite_raises``)."""
        self.runs_as_captured(index, phase, f"the rewritten graphs failed when run ({describe_error(error)})")
        log.warning("graph %d/%s: the rewritten graph raised (%s); it runs as captured",
                    index, phase, describe_error(error))

    def runs_as_captured(self, index: int, phase: str, why: str) -> None:
        """Graph ``index`` runs as captured from now on (``why``): its applied rows say so (and are
        reported again to ``on_row``)."""
        self.rewritten.pop((index, phase), None)
        for i, row in enumerate(self.rows):
            if (row.graph_index, row.phase) == (index, phase) and row.applied:
                self.rows[i] = not_run(row, why)
                if self.on_row is not None:  # the backend's on_report hears of it too
                    self.on_row(self.rows[i])

    def _add(self, row: PassReport) -> None:
        self.rows.append(row)
        log.info("pass %s on %d/%s: %s", row.name, row.graph_index, row.phase, row.reason)
        if self.on_row is not None:
            self.on_row(row)
