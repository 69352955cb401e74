"""Whole runs of the graphs a build's decision compares, timed in interleaved rounds, and which
of them stand for the module's calls (``Profiled.profile_side_by_side`` pools their samples).

A run right after another graph's can page-fault: it maps the pages the other run handed back
to the system (VGG-19 bs1's first convolutions and ReLUs 2-3x slower, 12,544 faults), where a
module's calls back to back reuse them (no fault). Such a graph is timed again back to back,
and its faulting runs are left out."""
from __future__ import annotations

from dataclasses import dataclass

import torch.fx as fx

from fxdream.runtime.host_memory import page_faults
from fxdream.sim.profile.in_context import time_graph

# A graph shorter than this (µs) runs once untimed before its timed run in each side-by-side
# round: right after another graph, its ops meet caches that graph filled, where a user's calls
# come back to back.
WARM_RUN_BELOW_US = 20_000.0
# A run that mapped this many fresh pages (1 MiB) met memory the allocator had handed back to
# the system, which calls of one module back to back reuse.
COLD_RUN_FAULTS = 256


@dataclass(frozen=True)
class TimedRun:
    """One run of a graph: its ops' times (µs per key), their sum, and the page faults the run
    took (None where the platform does not count them)."""
    samples: dict
    total_us: float
    page_faults: int | None


def faulted(run: TimedRun) -> bool:
    """Whether ``run`` mapped ``COLD_RUN_FAULTS`` fresh pages or more (False where not counted)."""
    return run.page_faults is not None and run.page_faults >= COLD_RUN_FAULTS


def warm_runs(runs: list[TimedRun]) -> list[TimedRun]:
    """``runs`` without those that faulted, where any did not: of two runs a faulting one would
    move the median by half its excess. A graph whose every run faulted keeps them all: back to
    back too it maps fresh memory."""
    warm = [run for run in runs if not faulted(run)]
    return warm if warm else runs


def interleaved_runs(cost, graphs: list[tuple[fx.GraphModule, object]], rounds: int) -> dict | None:
    """id(graph) → its runs: ``rounds`` rounds, each running every graph of ``graphs`` ((graph,
    real inputs it may update)) once in a rotated order; then, for a graph with fewer than two
    runs that did not fault, runs back to back (``_back_to_back``). ``cost``: the ``Profiled``
    whose current costs tell a short graph; None where a graph did not run."""
    runs: dict[int, list[TimedRun]] = {id(gm): [] for gm, _ in graphs}
    last = None
    for round_index in range(rounds):
        shift = round_index % len(graphs)
        for gm, inputs in graphs[shift:] + graphs[:shift]:
            run = _timed_run(cost, gm, inputs)
            if run is None:
                return None
            runs[id(gm)].append(run)
            last = gm
    for gm, inputs in sorted(graphs, key=lambda graph: graph[0] is not last):  # the last one run: at once
        faults = [faulted(run) for run in runs[id(gm)]]
        if any(faults) and faults.count(False) < 2 and not _back_to_back(cost, gm, inputs, runs[id(gm)], last is gm):
            return None
        last = None
    return runs


def _back_to_back(cost, gm: fx.GraphModule, inputs, runs: list[TimedRun], ran_last: bool) -> bool:
    """Time ``gm`` right after a run of its own, as a user's calls come (an untimed one unless
    ``ran_last``: its last timed run was the last run of all): one run, and a second where the
    first did not fault (two give a spread). Adds to ``runs``; False where ``gm`` did not run."""
    if not ran_last and time_graph(gm, inputs, cost.torch_device, {}, rounds=0, warmup=1) is None:
        return False
    for _ in range(2):  # each right after the one before
        run = _timed_run(cost, gm, inputs)
        if run is None:
            return False
        runs.append(run)
        if faulted(run) or sum(not faulted(earlier) for earlier in runs) >= 2:
            break
    return True


def _timed_run(cost, gm: fx.GraphModule, inputs) -> TimedRun | None:
    """One run of ``gm`` (after an untimed one where it is short, ``WARM_RUN_BELOW_US``); None
    where it does not run."""
    this_run: dict[str, list[float]] = {}
    warmup = int(cost.graph_total_us(gm) < WARM_RUN_BELOW_US)
    faults_before = page_faults()  # with a warm-up run: its and the timed run's, halved
    if time_graph(gm, inputs, cost.torch_device, this_run, 1, warmup, every_round=True) is None:
        return None
    faults = None if faults_before is None else (page_faults() - faults_before) // (1 + warmup)
    return TimedRun(this_run, sum(this_run[key][0] for key in cost.keys_of(gm)), faults)
