"""A prediction for this machine, its graph time rescaled to the state the built module runs in.

A build times its graphs' ops while it builds (in context, side by side); the module then runs
in a process the build has changed (glibc's heap, docs/measurements.md: a GNMT training step's
graphs ran ~20 % faster after its build than while it timed them). The build measures steps of
the built module (the host gaps of a training step or of a model with graph breaks; a few calls
of a single inference graph: ``host_gaps.StepCalls``), and those steps time each graph call too
(``StepCalls.calls_us``). The ratio of those calls' measured time to the same calls' predicted
time rescales the graph part of a prediction and its range; the measured host gaps stay as they
are, their range the spread of those steps. The predictions with and without the passes take
the one ratio, measured on the module with them, so the gain of their graphs stays the
side-by-side one. On a CPU only: a GPU's graph call returns before its kernels end.
"""
from __future__ import annotations

from typing import Collection

from fxdream.capturing.host_gaps import StepCalls
from fxdream.sim.call_order import HOST_GAP
from fxdream.sim.cost.run_spread import RunSpread
from fxdream.sim.prediction import Prediction


def graph_scale(step: StepCalls, prediction: Prediction, labels: Collection[str]) -> float | None:
    """The measured µs of ``step``'s calls of the graphs in ``labels`` over ``prediction``'s time
    outside its host gaps (its graphs, as the step called them); None where the calls were not
    timed, or on a device other than a CPU."""
    if prediction.device.kind != "cpu" or len(step.calls_us) != len(step.calls):
        return None
    measured_us = sum(us for label, us in zip(step.calls, step.calls_us) if label in labels)
    graphs_us = prediction.time_ms * 1e3 - host_gaps_us(prediction)
    return measured_us / graphs_us if measured_us > 0 and graphs_us > 0 else None


def rescaled_ms(prediction: Prediction, scale: float, step: StepCalls | None = None
                ) -> tuple[float, tuple[float, float]]:
    """(time, (low, high)) ms of ``prediction`` with its time outside the host gaps times ``scale``.
    The range's graph part is the prediction's; its gaps take the spread of ``step``'s sampled
    steps (``RunSpread``: a prediction interval of a further step), where it sampled two or more.
    The range is at least that spread of the whole time: the scale is measured on those steps,
    so a further step spreads as they did, whatever the graphs' own ops did side by side. The
    graph part is widened on both sides by the scale's own distance from 1: how far the graphs'
    speed moved between the build's side-by-side rounds and the module's calls seconds later,
    which a run after the build may move again, either way."""
    gaps_ms = host_gaps_us(prediction) / 1e3
    spread = RunSpread.of_runs(frozenset(), list(step.steps_us)) if step is not None else None
    low_share, high_share = (spread.low, spread.high) if spread is not None else (1.0, 1.0)
    low, high = prediction.time_ms_range
    time_ms = gaps_ms + scale * (prediction.time_ms - gaps_ms)
    drift = max(scale, 1 / scale)
    return time_ms, (min(gaps_ms * low_share + scale * (low - gaps_ms) / drift, time_ms * low_share),
                     max(gaps_ms * high_share + scale * (high - gaps_ms) * drift, time_ms * high_share))


def host_gaps_us(prediction: Prediction) -> float:
    """µs of ``prediction``'s host tasks for measured host gaps (``call_order.HOST_GAP``)."""
    return sum(t.duration_us for t in prediction.task_graph.tasks if t.op == HOST_GAP)
