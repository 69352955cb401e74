"""Which module ran in each host gap of a step: the eager code between graph calls, named.

A measured step's host gaps (``StepCalls`` in ``host_gaps``) are time the model spent outside its
compiled graphs: after a graph break, modules run as Python (an ``nn.LSTM`` in training, a head
behind ``torch.compiler.disable``). Each gap's time is split among the outermost calls of the
model's submodules that ran inside it, by the share of the gap each took, so that a prediction's
top layers and ``explain`` show those modules beside the graphs' layers. Module calls are timed by
a profile function on ``Module._call_impl`` frames (``sys.setprofile``) in a warm-up step, never in
a timed one: the function runs on every Python call, which lengthens the gaps. The shares are
that step's, a cold one, and so approximate.
"""
from __future__ import annotations

import contextlib
import sys
import time

import torch


@contextlib.contextmanager
def module_calls(model: torch.nn.Module):
    """A list, filled while the body runs, of (start, end, qualified name) of each call of one of
    ``model``'s submodules that ran as Python (the model itself is not named). Empty where a
    profile function is set already (a user's profiler keeps it)."""
    names = {id(m): name for name, m in model.named_modules() if name}
    calls: list[tuple[float, float, str]] = []
    if sys.getprofile() is not None:
        yield calls
        return
    call_impl = torch.nn.Module._call_impl.__code__
    started: dict = {}

    def profile(frame, event, _arg):
        if frame.f_code is not call_impl:
            return
        if event == "call":
            name = names.get(id(frame.f_locals.get("self")))
            if name is not None:
                started[frame] = (time.perf_counter(), name)
        elif event == "return" and frame in started:
            began, name = started.pop(frame)
            calls.append((began, time.perf_counter(), name))

    sys.setprofile(profile)
    try:
        yield calls
    finally:
        sys.setprofile(None)


def gap_layers(events: list[tuple], calls: list[tuple[float, float, str]],
               started: float, ended: float) -> tuple[tuple[tuple[str, float], ...], ...]:
    """Per gap of the step (before each graph call in ``events``, then after the last), the
    outermost module calls that began and ended inside it, each as (name, its share of the gap's
    time), in the order they ran; the rest of the gap (Python glue, a loss, autograd's engine)
    is no module's."""
    bounds, cursor = [], started
    for _, start, end, *_ in sorted(events, key=lambda e: e[1]):
        bounds.append((cursor, start))
        cursor = max(cursor, end)
    bounds.append((cursor, ended))
    return tuple(_outermost(calls, low, high) for low, high in bounds)


def _outermost(calls: list[tuple[float, float, str]], low: float, high: float) -> tuple[tuple[str, float], ...]:
    inside = sorted((c for c in calls if low <= c[0] and c[1] <= high), key=lambda c: (c[0], -c[1]))
    kept, reach = [], low
    for begin, end, name in inside:
        if begin >= reach:  # not nested in the call kept before it
            kept.append((name, (end - begin) / (high - low)))
            reach = end
    return tuple(kept)
