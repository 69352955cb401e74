"""capture(): a model's ATen graphs by the first path that takes it (torch.fx, dynamo, blocks)."""
from __future__ import annotations

import torch

from fxdream.capturing.arguments import TORCHSCRIPT_MODEL, check_model, inside_torch_compile
from fxdream.capturing.blockwise import capture_after_nothing
from fxdream.capturing.captured import CaptureError
from fxdream.capturing.causal_mask import causal_checks_unread
from fxdream.capturing.dynamo import (
    describe_error,
    dynamo_state_kept,
    graph_break_counts,
    meta_kernel_errors_unlogged,
    new_graph_breaks,
)
from fxdream.capturing.eager_ops import record_model_calls
from fxdream.capturing.host_gaps import StepCalls, describe_calls, describe_gaps, measure_model_gaps, worth_measuring
from fxdream.capturing.keywords import bind_keywords
from fxdream.capturing.meta import on_meta, traceable_on_meta
from fxdream.capturing.model_state import initialize_lazy_modules, preserved_modes, switch_to_build_mode
from fxdream.capturing.session import CaptureSession
from fxdream.capturing.steps import run_once, tracing_config
from fxdream.capturing.torch_fx import compile_model


def capture(model: torch.nn.Module, example_inputs=(), training: bool = False, example_kwargs: dict | None = None):
    """Capture ``model`` at ``example_inputs`` (and keyword inputs ``example_kwargs``): a
    ``Captured``, or a tuple of them after graph breaks.

    The model's grads, buffers, RNG state and every submodule's train/eval flag are left as they
    were (during the capture, a model whose own flag is not ``training`` is switched whole:
    ``switch_to_build_mode``). Raises ``CaptureError`` when dynamo captured nothing.
    """
    return capture_with_host_gaps(model, example_inputs, training, measure=False, example_kwargs=example_kwargs,
                                  call_order=False)[0]


def capture_with_host_gaps(model: torch.nn.Module, example_inputs=(), training: bool = False,
                           measure: bool = True, example_kwargs: dict | None = None,
                           call_order: bool = True) -> tuple:
    """``capture``, plus (when ``measure`` and it is a training step or the graph broke) the
    graph calls and host time outside the graphs of a few steps: (captured, StepCalls or None, notes).
    Without ``measure``, where the graph broke and ``call_order``: the order of one step's graph
    calls, without times (``record_model_calls``)."""
    check_model(model)
    model = inside_torch_compile(model)
    if isinstance(model, torch.jit.ScriptModule):
        raise CaptureError(f"{type(model).__name__} is {TORCHSCRIPT_MODEL}; capture (and predict) the original "
                           "nn.Module instead")
    model, inputs = bind_keywords(model, example_inputs, example_kwargs)
    initialize_lazy_modules(model, inputs)
    with preserved_modes(model), dynamo_state_kept():
        switch_to_build_mode(model, training)
        return _capture(model, inputs, training, measure, call_order)


def _capture(model: torch.nn.Module, inputs: tuple, training: bool, measure: bool, call_order: bool) -> tuple:
    session = CaptureSession(model)
    breaks_before, how = graph_break_counts(), "dynamo"
    try:
        # the causal checks: in graphs that never run (not measured)
        with causal_checks_unread(active=not measure) as mask_checks, meta_kernel_errors_unlogged():
            runner, how = compile_model(model, inputs, session, training)
            run_once(runner, model, inputs, training)
            if not session.captured():
                retried = capture_after_nothing(model, inputs, session, training, new_graph_breaks(breaks_before))
                runner = retried[0] if retried else runner
            # the graphs run as compiled (inside the checks' context: outside it dynamo compiles again)
            order = _call_order(runner, model, inputs, training, session, breaks_before) if (
                not measure and call_order) else None
    except Exception as error:
        run_once(model, model, inputs, training)  # the model's own error, if eager fails too
        raise CaptureError(f"the capture of {type(model).__name__} ({how}) failed: {describe_error(error)}") from error
    captured, breaks = session.captured(), new_graph_breaks(breaks_before)
    nothing = f"nothing was captured from {type(model).__name__}: {'; '.join(breaks) or 'dynamo produced no graph'}"
    step, notes = None, () if measure else _unmeasured_breaks(breaks, order) + mask_checks.note()
    if measure and worth_measuring(training, len(captured), len(breaks)):
        step = measure_model_gaps(runner, model, inputs, training, session.clock, anchors=_anchors(session),
                                  named=bool(breaks) or len(captured) > 1)
        if step is None:
            notes = ()
        elif captured:
            notes = describe_gaps(step, len(captured), training, len(breaks))
        else:  # the whole step is one measured host task
            notes = (f"{nothing}; the whole step ran as eager code, predicted from its time measured here "
                     f"({step.total_us / 1e3:.3f} ms per step)",)
    elif order is not None and (captured or order.eager_before):
        step, notes = order, notes + describe_calls(order)
        if not captured:
            notes = (f"{nothing}; the whole step ran as eager code, predicted from its ATen ops",) + notes
    session.forget_real_tensors()  # the model's tensors free to be swapped again
    if not captured and step is None:  # no graph to cost, and no time measured
        raise CaptureError(nothing if measure else f"{nothing}; fxdream.simulate for this machine with real inputs "
                                                   f"(cost='auto') measures the step as eager code instead")
    return (captured[0] if len(captured) == 1 else tuple(captured)), step, notes


def _call_order(runner, model, inputs: tuple, training: bool, session: CaptureSession, breaks_before):
    """``record_model_calls`` where the graph broke (the order of the graph calls and how many
    are not known from the graphs alone), else None; None too where recording fails: the
    prediction then costs each graph once."""
    if len(session.captured()) == 1 and not new_graph_breaks(breaks_before):
        return None
    meta = on_meta(model, inputs)
    try:
        with traceable_on_meta(meta), tracing_config(training, meta):  # as the capture's step ran
            return record_model_calls(runner, model, inputs, training, session.clock, _anchors(session))
    except Exception:  # a step that ran once may fail again (a model that changes itself): order unknown
        return None


def _anchors(session: CaptureSession) -> dict[int, tuple[str, str]]:
    """Graph index → where its frame sits in the model and a parameter's path below it."""
    return {r.index: r.anchor for r in session.records if r.anchor}


def _unmeasured_breaks(breaks: list[str], order: StepCalls | None) -> tuple[str, ...]:
    """Where the graph broke and nothing is measured (a prediction for another device, or on the
    meta device), what became of the eager code between the graphs: its ops, recorded in
    ``order``, costed from their shapes, or (not recorded) in no task; with the first reason."""
    if not breaks:
        return ()
    more = f", and {len(breaks) - 1} more" if len(breaks) > 1 else ""
    if order is None:
        return (f"not in this prediction: the eager code where the graph broke ({breaks[0]}{more}); its time is "
                f"measured only in a prediction for this machine with real inputs (cost='auto')",)
    ops = sum(1 for graphs in order.eager_before.values() for _, gm in graphs for n in gm.graph.nodes
              if isinstance(n.target, torch._ops.OpOverload))
    skipped = sum(order.eager_skipped.values())
    names = ", ".join(f"{name} x{n}" for name, n in sorted(order.eager_skipped.items(), key=lambda kv: -kv[1])[:5])
    if not ops and not skipped:
        return (f"the eager code where the graph broke ({breaks[0]}{more}): no ATen op ran there in a step "
                f"recorded after the capture's (its Python is not in this prediction)",)
    return (f"the eager code where the graph broke ({breaks[0]}{more}): {ops} ATen ops, recorded in one step and "
            f"costed from their shapes as a graph's ops are (its Python is not)"
            + (f"; {skipped} ops not replayed, not in this prediction ({names})" if skipped else ""),)
