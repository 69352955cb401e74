"""optimize(): capture → passes → executable module, as an explicit list of steps."""
from __future__ import annotations

import copy
import logging
import dataclasses
import time
import traceback
from typing import Callable

import torch
import torch.fx as fx

from .capture import (CaptureError, CaptureSession, compile_with, describe_error,
                      graph_break_counts, new_graph_breaks, run_once)
from .pass_api import Pass, PassContext, resolve_passes
from .predict import cost_model_for, graph_prediction, this_machine_device
from .report import GraphReport, PassReport, Report
from .validate import check_flag, check_inputs, check_model, resolve_device


log = logging.getLogger("fxdream")


class PassPipeline:
    """Runs passes in order on each captured graph; a pass that fails is skipped and reported."""

    def __init__(self, passes: tuple[Pass, ...], base_context: PassContext,
                 on_row: Callable[[PassReport], None] | None = None):
        self.passes = passes
        self.base_context = base_context
        self.on_row = on_row
        self.rows: list[PassReport] = []
        self.rewritten: dict[tuple[int, str], fx.GraphModule] = {}  # (subgraph, phase) → graph run

    def _predict(self, gm: fx.GraphModule, phase: str) -> tuple[float, int] | None:
        cost = self.base_context.cost_model
        return None if cost is None else graph_prediction(gm, cost, phase)

    def __call__(self, gm: fx.GraphModule, phase: str, index: int, params: dict) -> fx.GraphModule:
        predict_us = None
        if self.base_context.cost_model is not None:
            def predict_us(candidate: fx.GraphModule) -> float:
                return self._predict(candidate, phase)[0]
        ctx = dataclasses.replace(self.base_context, phase=phase, params=params, predict_us=predict_us)
        for p in self.passes:
            gm = self._run_one(p, gm, ctx, index)
        self.rewritten[(index, phase)] = gm
        return gm

    def _run_one(self, p: Pass, gm: fx.GraphModule, ctx: PassContext, index: int) -> fx.GraphModule:
        not_applicable = p.applies_to(ctx)
        if not_applicable is not None:
            self._add(PassReport(p.name, index, ctx.phase, False, not_applicable))
            return gm
        try:
            result = p(copy_graph_module(gm), ctx)
            result.graph_module.graph.lint()
            result.graph_module.recompile()
        except Exception as error:  # a broken pass must never break the model
            where = traceback.extract_tb(error.__traceback__)[-1]
            reason = (f"skipped: the pass raised {type(error).__name__}: {error} "
                      f"({where.filename.rsplit('/', 1)[-1]}:{where.lineno})")
            self._add(PassReport(p.name, index, ctx.phase, False, reason))
            return gm
        delta_us = delta_peak = None
        if result.modified and self.base_context.cost_model is not None:
            (before_us, before_peak), (after_us, after_peak) = (self._predict(gm, ctx.phase),
                                                                self._predict(result.graph_module, ctx.phase))
            delta_us, delta_peak = after_us - before_us, after_peak - before_peak
        self._add(PassReport(p.name, index, ctx.phase, result.modified, result.reason, result.notes,
                             predicted_delta_us=delta_us, predicted_delta_peak_bytes=delta_peak))
        return result.graph_module if result.modified else gm

    def _add(self, row: PassReport) -> None:
        self.rows.append(row)
        log.info("pass %s on %d/%s: %s", row.name, row.graph_index, row.phase, row.reason)
        if self.on_row is not None:
            self.on_row(row)


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy whose graph a pass may rewrite freely (attributes are shared, not cloned)."""
    graph = copy.deepcopy(gm.graph)
    return fx.GraphModule(gm, graph, class_name=type(gm).__name__)


class OptimizedModule(torch.nn.Module):
    """The model, run through its captured (and rewritten) graphs. ``.report`` says how."""

    def __init__(self, model: torch.nn.Module, runner: Callable, session: CaptureSession,
                 pipeline: PassPipeline, training: bool, device: torch.device, strict: bool):
        super().__init__()
        self.model = model
        # The compiled runner wraps ``model``; keep it out of the module tree (no duplicate params).
        self.__dict__["_runner"] = runner
        self.__dict__["_session"] = session
        self.__dict__["_pipeline"] = pipeline
        self._inference = not training
        self._device = device
        self._strict = strict
        self._graph_breaks: tuple[str, ...] = ()
        self._fallback_reason: str | None = None
        self._build_seconds = 0.0

    def forward(self, *args, **kwargs):
        if self._fallback_reason is not None:
            return self._call(self.model, args, kwargs)
        try:
            return self._call(self._runner, args, kwargs)
        except torch._dynamo.exc.TorchDynamoException as error:
            if self._strict:
                raise
            self._fall_back(f"compilation failed on a later call: {describe_error(error)}")
            return self._call(self.model, args, kwargs)

    def _call(self, fn: Callable, args, kwargs):
        if self._inference:
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    def _fall_back(self, reason: str) -> None:
        self._fallback_reason = reason

    @property
    def report(self) -> Report:
        """A snapshot of what was captured and what the passes did (complete after one step)."""
        captured = self._session.captured()
        return Report(model=type(self.model).__name__, training=not self._inference,
                      device=str(self._device), graphs=tuple(GraphReport.of(c) for c in captured),
                      graph_breaks=self._graph_breaks, fallback_reason=self._fallback_reason,
                      passes=tuple(self._pipeline.rows), build_seconds=self._build_seconds)

    @property
    def captured(self):
        """The ``Captured`` graphs (as captured, before passes) of every subgraph so far."""
        return self._session.captured()

    @property
    def rewritten_graphs(self) -> dict:
        """(subgraph index, phase) → the graph the passes produced (absent: ran as captured)."""
        return dict(self._pipeline.rewritten)


def optimize(model: torch.nn.Module, example_inputs, passes=(), training: bool = False,
             device=None, strict: bool = False, cost: str | None = "auto") -> OptimizedModule:
    """Capture ``model`` at ``example_inputs``, apply ``passes``, and return a module equal to eager.

    The module runs through the captured graphs; ``.report`` tells what was captured,
    where dynamo broke the graph, and what each pass did. When dynamo cannot trace the
    model it runs eagerly and the report says why; ``strict=True`` raises instead
    (also on graph breaks, where parts of the model would run eagerly).

    ``cost`` is the cost model passes are judged with: "auto" (measured on this machine),
    "profiled", "analytic", or None for no predictions.
    """
    check_model(model)
    inputs = check_inputs(example_inputs)
    training = check_flag("training", training)
    strict = check_flag("strict", strict)
    selected = resolve_passes(passes)
    target = resolve_device(device, model, inputs)

    started = time.perf_counter()
    model.train(training)
    cost_model = cost_model_for(this_machine_device(target), cost) if selected and cost else None
    pipeline = PassPipeline(selected, PassContext(device=target.type, training=training,
                                                  cost_model=cost_model))
    session = CaptureSession(model, transform=pipeline if selected else None)
    runner = compile_with(model, session)
    module = OptimizedModule(model, runner, session, pipeline, training, target, strict)
    breaks_before = graph_break_counts()
    try:
        run_once(runner, model, inputs, training)
    except Exception as error:
        if strict:
            raise CaptureError(f"strict=True: capture of {type(model).__name__} failed: "
                               f"{describe_error(error)}") from error
        run_once(model, model, inputs, training)  # if eager fails too, the model itself is broken
        module._fall_back(f"dynamo could not capture the model: {describe_error(error)}")
    module._graph_breaks = new_graph_breaks(breaks_before)
    if module._fallback_reason is None and not session.captured():
        module._fall_back("dynamo captured no graph"
                          + (": " + "; ".join(module._graph_breaks) if module._graph_breaks else ""))
    if strict and (module._fallback_reason or module._graph_breaks):
        raise CaptureError(f"strict=True: {type(model).__name__} is not captured whole: "
                           + (module._fallback_reason or "graph breaks: " + "; ".join(module._graph_breaks)))
    module._build_seconds = time.perf_counter() - started
    return module
