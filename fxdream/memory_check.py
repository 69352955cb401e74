"""A step's measured peak memory, to put beside the simulator's predicted peak.

``peak_bytes_during(step)`` is the most memory the step's own allocations held at once, above
what was allocated before it began (weights, inputs, anything kept from earlier calls): on a
GPU, ``torch.cuda.max_memory_allocated`` over the step; on a CPU, the allocations and frees
``torch.profiler`` records with ``profile_memory=True``, replayed in time order. The CPU
reading holds for steps whose ops the profiler sees one by one (an inference call through
captured graphs); it does not for a training step through aot_autograd: the profiler books the
frees made inside a compiled autograd function at that function's start, so the step reads
low (a captured conv net's training step as its forward alone). It compares
with a prediction's ``peak_memory_bytes - static_bytes``. Clear what the step should not
count before calling it (``p.grad = None``: a step that frees last step's gradients starts by
giving back their memory, which this would read as a negative).
"""
from __future__ import annotations

from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def peak_bytes_during(step: Callable[[], object], device: str | torch.device = "cpu") -> int:
    """The peak of ``step``'s allocations above those alive when it starts (one call)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        step()
    return _replayed_peak(recorded.events())


def _replayed_peak(events) -> int:
    """An op's own allocations count when it starts; a ``[memory]`` event is a free (or an
    allocation outside any op) at its time."""
    held = peak = 0
    for event in sorted(events, key=lambda e: e.time_range.start):
        held += event.cpu_memory_usage if event.name == "[memory]" else event.self_cpu_memory_usage
        peak = max(peak, held)
    return peak
