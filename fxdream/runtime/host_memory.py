"""The host's allocator: the page faults of fresh memory, and glibc's malloc told to keep freed memory.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc's malloc maps a buffer above its
mmap threshold (128 KiB at first, raised up to 32 MiB as such buffers are freed) with pages of its
own and unmaps them when the buffer is freed, and it hands the top of its heap back to the system
past a trim threshold. A step whose large buffers come back fresh on every call pays a page fault
for every 4 KiB page it writes, and its time moves with what the kernel (and, in a virtual
machine, the hypervisor) charges for one (measurements: docs/api.md, "Fresh memory on the CPU").

Keeping freed memory is a trade for the whole process, so it is the user's call, never made by a
build: the heap holds on to its peak (the resident memory never shrinks), and a small model run
after a large one allocates from a larger, more scattered heap. Allocators such as jemalloc or
tcmalloc (``LD_PRELOAD``) avoid both the faults and most of the trade; ``keep_freed_memory`` is
the switch that needs nothing installed.
"""
from __future__ import annotations

import ctypes
import functools
import platform
from dataclasses import dataclass

import torch

try:
    import resource
except ImportError:  # not on Windows: faults are not counted there
    resource = None

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
KEPT_BYTES = 2**31 - 1  # mallopt takes a C int: the largest threshold it can be told
# page faults per call past which a measured module's report says what they are: 1024 pages
# (4 MiB) of fresh memory take a millisecond or more, and their cost moves with the machine
FAULTS_WORTH_A_NOTE = 1024


# glibc's ceiling for the mmap threshold it raises by itself (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
DYNAMIC_MMAP_THRESHOLD_MAX = 32 * 2**20


@functools.cache
def settle_dynamic_thresholds() -> None:
    """Put glibc's malloc where it goes by itself once the process has freed a buffer of 32 MiB:
    its mmap threshold at its ceiling (32 MiB) and its trim threshold at twice that, so buffers
    under 32 MiB come from the heap and up to 64 MiB of freed memory stays at its top. Until a
    process has freed so large a buffer, the thresholds sit at the largest buffer it freed, and a
    step that frees a few MiB more at the heap's top gives them back to the system and faults them
    in again on the next step: a build timed in that state (a process's first small model) read up
    to 17 % slower than the module ran after it (docs/measurements.md). One buffer of that size
    allocated and freed unwritten (no page touched), once per process; no mallopt, so glibc keeps
    adjusting them as it would."""
    if _glibc() is not None:
        torch.empty(DYNAMIC_MMAP_THRESHOLD_MAX - 2**16, dtype=torch.uint8)  # freed at once


@dataclass(frozen=True)
class FreedMemoryKept:
    """What ``keep_freed_memory`` set: buffers below ``mmap_threshold_bytes`` come from the heap,
    and the heap keeps up to ``trim_threshold_bytes`` of free memory at its top."""
    mmap_threshold_bytes: int
    trim_threshold_bytes: int


def keep_freed_memory() -> FreedMemoryKept:
    """Tell glibc's malloc to keep the memory this process frees (both thresholds at
    ``KEPT_BYTES``), so that buffers a later call allocates reuse pages already touched instead
    of faulting in fresh ones. For the rest of the process, and for all of it (see the module's
    docstring for the trade). Raises RuntimeError where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        raise RuntimeError(f"keep_freed_memory needs glibc's malloc (Linux); this process's C library is "
                           f"{platform.libc_ver()[0] or 'not glibc'} on {platform.system()}. An allocator that "
                           f"keeps freed memory by itself (jemalloc, tcmalloc via LD_PRELOAD) needs no switch")
    for parameter, name in ((M_MMAP_THRESHOLD, "M_MMAP_THRESHOLD"), (M_TRIM_THRESHOLD, "M_TRIM_THRESHOLD")):
        if libc.mallopt(parameter, KEPT_BYTES) != 1:
            raise RuntimeError(f"glibc's mallopt refused {name}={KEPT_BYTES}")
    return FreedMemoryKept(KEPT_BYTES, KEPT_BYTES)


def page_faults() -> int | None:
    """The minor page faults of every thread of this process so far (a fresh page mapped on its
    first write); None where the platform does not count them."""
    if resource is None:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def page_bytes() -> int:
    """Bytes in one page of memory (what one fault maps)."""
    return resource.getpagesize() if resource is not None else 4096


def fresh_memory_note(faults_per_call: float | None) -> str | None:
    """What a measured call's page faults are, where they are many (``FAULTS_WORTH_A_NOTE``), and
    the switch; None where they are few or not counted."""
    if faults_per_call is None or faults_per_call < FAULTS_WORTH_A_NOTE:
        return None
    return (f"a call of the optimized module page-faulted {faults_per_call:,.0f} times "
            f"({_mib(faults_per_call)} MiB of fresh pages from the allocator), which makes "
            f"its time move from call to call; fxdream.keep_freed_memory() makes glibc's malloc keep freed memory "
            f"for the rest of the process (a trade: docs/api.md)")


def timed_fresh_memory_note(baseline_faults: float | None, optimized_faults: float | None) -> str | None:
    """What the runs a build timed side by side page-faulted, where either side's run did
    ``FAULTS_WORTH_A_NOTE`` or more: such a run reads slower than one that reuses freed memory,
    and which runs do follows the process's allocations, not the graph."""
    counted = [f for f in (baseline_faults, optimized_faults) if f is not None]
    if not counted or max(counted) < FAULTS_WORTH_A_NOTE:
        return None
    sides = [f"{name} page-faulted {faults:,.0f} times a run ({_mib(faults)} MiB of fresh memory)"
             for name, faults in (("the capture without passes", baseline_faults),
                                  ("the optimized graphs", optimized_faults)) if faults is not None]
    return (f"while the build timed them, {' and '.join(sides)}: such runs read slower than runs that reuse "
            f"freed memory, and which runs do follows the process's allocations, so later calls may run faster "
            f"than predicted (fxdream.keep_freed_memory(), docs/api.md)")


def _mib(faults: float) -> str:
    """The MiB ``faults`` pages map, as a note gives it."""
    return f"{faults * page_bytes() / 2**20:,.0f}"


def _glibc() -> ctypes.CDLL | None:
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    return ctypes.CDLL("libc.so.6")
