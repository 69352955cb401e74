"""A step's measured peak memory, to put beside the simulator's predicted peak.

``peak_bytes_during(step)`` is the most memory the step's ops held at once, above what was
allocated before it began (weights, inputs, anything kept from earlier calls): on a GPU,
``torch.cuda.max_memory_allocated`` over the step; on a CPU, ``torch.profiler``'s record of each
op (``profile_memory=True``), its net allocation counted when it starts: the op outputs the
simulator models, without the temporaries an op frees before it returns. That reading holds for
steps whose ops the profiler sees one by one (an inference call through captured graphs); not
for a training step through aot_autograd, whose compiled function's ops the profiler books at
that function's start.

``allocated_peak_bytes_during(step)`` replays every allocation and free the CPU allocator made
(the profiler's ``[memory]`` records, inside ops too) in time order: what the step really held,
op workspaces included, and right for training steps too: the reading a prediction is checked
against (the simulator holds the workspaces it knows, ``fxdream.sim.workspaces``).

Both compare with a prediction's ``peak_memory_bytes - static_bytes``. Clear what the step should
not count before calling it (``p.grad = None``: a step that frees last step's gradients starts by
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
    # an op's own allocations count when it starts; a "[memory]" event is a free (or an
    # allocation outside any op) at its time
    events = sorted(_recorded(step).events(), key=lambda e: e.time_range.start)
    return _running_peak(e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage for e in events)


def allocated_peak_bytes_during(step: Callable[[], object]) -> int:
    """The peak of every CPU allocation ``step`` made above those alive when it starts (one
    call), workspaces inside ops included: the allocator's records replayed in time order."""
    records = [e for e in _recorded(step).profiler.kineto_results.events() if e.name() == "[memory]"]
    return _running_peak(r.nbytes() for r in sorted(records, key=lambda e: e.start_ns()))


def _recorded(step: Callable[[], object]) -> profile:
    """One call of ``step`` under torch.profiler with its memory records."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as recorded:
        step()
    return recorded


def _running_peak(deltas) -> int:
    """The largest running sum of byte changes taken in order (0 if it never rises)."""
    held = peak = 0
    for delta in deltas:
        held += delta
        peak = max(peak, held)
    return peak
