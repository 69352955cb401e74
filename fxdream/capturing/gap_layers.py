"""Which module ran in each host gap of a step: the eager code between graph calls, named.

A measured step's host gaps (``StepCalls`` in ``host_gaps``) are time the model spent outside its
compiled graphs: after a graph break, modules run as Python (an ``nn.LSTM`` in training, a head
behind ``torch.compiler.disable``). A gap is named by the longest call of one of the model's
submodules that began and ended inside it, so that a prediction's top layers and ``explain``
show that module beside the graphs' layers. Module calls are timed by a profile function on
``Module._call_impl`` frames (``sys.setprofile``), in a step of their own: the function runs on
every Python call, which would lengthen the gaps it names.
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


def gap_layers(events: list[tuple[str, float, float]], calls: list[tuple[float, float, str]],
               started: float, ended: float) -> tuple[str, ...]:
    """Per gap of the step (before each graph call in ``events``, then after the last), the name
    of the longest module call that began and ended inside it; "" where none did."""
    bounds, cursor = [], started
    for _, start, end in sorted(events, key=lambda e: e[1]):
        bounds.append((cursor, start))
        cursor = max(cursor, end)
    bounds.append((cursor, ended))
    return tuple(max(((end - begin, name) for begin, end, name in calls if low <= begin and end <= high),
                     default=(0.0, ""))[1] for low, high in bounds)


def name_gaps(step, clock, model: torch.nn.Module, calls: tuple[str, ...]) -> tuple[str, ...]:
    """``gap_layers`` of one more run of ``step`` with its module calls timed; () where that run
    called other graphs than ``calls`` (a step that compiled, a branch on data)."""
    clock.events = []
    try:
        with module_calls(model) as modules:
            started = time.perf_counter()
            step()
            ended = time.perf_counter()
        events = clock.events
    finally:
        clock.events = None
    if tuple(label for label, _, _ in sorted(events, key=lambda e: e[1])) != calls:
        return ()
    return gap_layers(events, modules, started, ended)
