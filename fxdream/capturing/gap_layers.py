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
from typing import Callable

import torch


@contextlib.contextmanager
def on_module_calls(model: torch.nn.Module, enter: Callable[[str], object], leave: Callable[[object], None],
                    on_c_call: Callable[[object], None] | None = None):
    """While the body runs, ``enter(name)`` as each call of one of ``model``'s submodules that
    runs as Python (eagerly) begins, with its qualified name (the model itself is not named), and
    ``leave(token)`` with what ``enter`` returned as it ends; ``on_c_call(function)`` before each
    call of a C function, where given. By a profile function on ``Module._call_impl`` frames
    (``sys.setprofile``): module hooks would change what dynamo guards on, and it would compile
    again. Nothing where a profile function is set already (a user's profiler keeps it). A call
    the body left by raising is ended when the body is."""
    names = {id(m): name for name, m in model.named_modules() if name}
    if sys.getprofile() is not None:
        yield
        return
    call_impl = torch.nn.Module._call_impl.__code__
    open_calls: dict = {}

    def profile(frame, event, arg):
        if event == "c_call":
            if on_c_call is not None:
                on_c_call(arg)
            return
        if frame.f_code is not call_impl:
            return
        if event == "call":
            name = names.get(id(frame.f_locals.get("self")))
            if name is not None:
                open_calls[frame] = enter(name)
        elif event == "return" and frame in open_calls:
            leave(open_calls.pop(frame))

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(None)
        for token in reversed(list(open_calls.values())):
            leave(token)


@contextlib.contextmanager
def module_calls(model: torch.nn.Module):
    """A list, filled while the body runs, of (start, end, qualified name) of each call of one of
    ``model``'s submodules that ran as Python (``on_module_calls``); empty where a profile
    function is set already."""
    calls: list[tuple[float, float, str]] = []

    def leave(started: tuple[float, str]) -> None:
        calls.append((started[0], time.perf_counter(), started[1]))
    with on_module_calls(model, lambda name: (time.perf_counter(), name), leave):
        yield calls


def gap_layers(events: list[tuple], calls: list[tuple[float, float, str]],
               started: float, ended: float) -> tuple[tuple[tuple[str, float], ...], ...]:
    """Per gap of the step (before each graph call in ``events``, then after the last), the
    outermost module calls that began and ended inside it, each as (name, its share of the gap's
    time), in the order they ran; the rest of the gap (Python glue, a loss, autograd's engine)
    is no module's."""
    return tuple(_outermost(calls, low, high) for low, high in gap_bounds(events, started, ended))


def gap_bounds(events: list[tuple], started: float, ended: float) -> list[tuple[float, float]]:
    """(from, to) of each gap of a step that ran from ``started`` to ``ended``: before each graph
    call in ``events`` ((label, start, end, ...), in any order), in start order, then after the
    last. A gap is empty (to ≤ from) where a call began before the one before it ended."""
    bounds, cursor = [], started
    for _, start, end, *_ in sorted(events, key=lambda e: e[1]):
        bounds.append((cursor, start))
        cursor = max(cursor, end)
    bounds.append((cursor, ended))
    return bounds


def _outermost(calls: list[tuple[float, float, str]], low: float, high: float) -> tuple[tuple[str, float], ...]:
    inside = sorted((c for c in calls if low <= c[0] and c[1] <= high), key=lambda c: (c[0], -c[1]))
    kept, reach = [], low
    for begin, end, name in inside:
        if begin >= reach:  # not nested in the call kept before it
            kept.append((name, (end - begin) / (high - low)))
            reach = end
    return tuple(kept)
