"""Wall-clock timing that holds up on a noisy machine: warm-up, blocks, interleaved, median.

Runners are timed in blocks of calls: single calls alternated one by one bias the comparison
even between two identical models. Blocks in a fixed order are biased too (the block right
after another runner's, eager's above all, runs slow), so each block starts with an untimed
call, and the order rotates, each runner first in as many rounds as the others.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Mapping

import torch

from fxdream.runtime.host_memory import page_faults


@dataclass(frozen=True)
class Measurement:
    """Milliseconds per call: median over rounds, and the spread (min, max) of the rounds;
    ``page_faults_per_call``: the process's minor page faults per call, median over rounds (fresh
    pages the allocator mapped: ``fxdream.runtime.host_memory``; None where not counted)."""
    median_ms: float
    min_ms: float
    max_ms: float
    rounds: int
    calls_per_round: int
    page_faults_per_call: float | None = None

    @property
    def spread_pct(self) -> float:
        return 100.0 * (self.max_ms - self.min_ms) / self.median_ms if self.median_ms else 0.0


def _synchronize() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def time_interleaved(runners: Mapping[str, Callable[[], object]], rounds: int = 5, block: int = 10,
                     warmup: int = 3, progress: bool = True, desc: str = "timing") -> dict[str, Measurement]:
    """Time each runner in blocks of ``block`` calls, rotating the order every round.

    ``rounds`` is rounded up to a multiple of the number of runners (``Measurement.rounds``)."""
    if rounds < 1 or block < 1:
        raise ValueError(f"rounds and block must be >= 1, got rounds={rounds}, block={block}")
    for run in runners.values():
        for _ in range(warmup):
            run()
    _synchronize()
    samples: dict[str, list[float]] = {name: [] for name in runners}
    faults: dict[str, list[float]] = {name: [] for name in runners}
    order = list(runners)
    rounds = -(-rounds // len(order)) * len(order)  # a multiple of the runners: every position equally often
    bar = _progress(total=rounds * len(runners), desc=desc, enabled=progress)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:  # round r starts at runner r
            run = runners[name]
            run()  # untimed: the first call after another runner's block is slow (caches, allocator)
            _synchronize()
            faults_before, started = page_faults(), time.perf_counter()
            for _ in range(block):
                run()
            _synchronize()
            samples[name].append((time.perf_counter() - started) * 1e3 / block)
            if faults_before is not None:
                faults[name].append((page_faults() - faults_before) / block)
            bar.update(1)
    bar.close()
    return {name: Measurement(statistics.median(s), min(s), max(s), rounds, block,
                              statistics.median(faults[name]) if faults[name] else None)
            for name, s in samples.items()}


def _progress(total: int, desc: str, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is a dependency, but never let a progress bar break a measurement
        enabled = False
    if not enabled:
        class _Silent:
            def update(self, n): pass
            def close(self): pass
        return _Silent()
    return tqdm(total=total, desc=desc, leave=False, unit="block")
