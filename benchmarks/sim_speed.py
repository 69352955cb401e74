"""Simulator throughput on a synthetic 100k-task graph (target: >= 200k tasks/s).

The graph mimics an eager training step: one CPU launch thread, two GPU streams.  Per op: a
CPU launch task (cpu:0) and a kernel; kernels mostly on stream 0, every 4th on stream 1 with an
event back to stream 0; every 500 ops a GPU -> CPU sync.  Edges: cpu sequential, launch,
same-stream, event, sync.

    python benchmarks/sim_speed.py [--tasks 100000] [--repeat 3]
"""
from __future__ import annotations

import argparse
import time

from fxdream.sim import Contention, Task, TaskGraph, simulate
from fxdream.sim.taskgraph import DepKind


def build(n_tasks: int = 100_000) -> TaskGraph:
    g = TaskGraph()
    i = 0
    last_aux = None
    while len(g) < n_tasks:
        launch = g.append(Task.cpu(f"launch{i}", 4.0, op="launch"))
        stream = 1 if i % 4 == 3 else 0
        deps = [(launch, DepKind.LAUNCH)]
        if stream == 0 and last_aux is not None:
            deps.append((last_aux, DepKind.EVENT))  # stream 0 waits for the aux kernel
            last_aux = None
        k = g.append(Task.gpu(f"k{i}", 3.0 + (i % 7), stream=stream, layer=f"layer{i // 20}",
                              mem_alloc=1024 * (i % 3), mem_free=1024 * (i % 3),
                              utilization=0.5 + 0.1 * (i % 5)), deps=deps)
        if stream == 1:
            last_aux = k
        if i % 500 == 499 and len(g) < n_tasks:
            g.append(Task.sync(f"sync{i}", 1.0), deps=[(k, DepKind.SYNC)])
        i += 1
    return g


def _best(fn, repeat):
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    t0 = time.perf_counter()
    g = build(args.tasks)
    t_build = time.perf_counter() - t0
    n = len(g)
    print(f"graph: {n} tasks, {g.nx.number_of_edges()} deps, built in {t_build:.2f} s "
          f"({n / t_build / 1e3:.0f}k tasks/s through TaskGraph.append)")

    def report(label, secs, tl):
        print(f"{label:<44} {secs * 1e3:7.1f} ms  {n / secs / 1e3:6.0f}k tasks/s  "
              f"(makespan {tl.makespan_us / 1e3:.1f} ms)")

    secs, tl = _best(lambda: simulate(g), args.repeat)
    report("simulate (arrays kept by the builder)", secs, tl)
    # a what-if graph: its integer arrays are rebuilt from networkx inside simulate
    secs = float("inf")
    for _ in range(args.repeat):
        h = g.scale(g.select(kind="gpu"), 0.5)
        t0 = time.perf_counter()
        tl = simulate(h)
        secs = min(secs, time.perf_counter() - t0)
    report("simulate (first call on a scaled copy)", secs, tl)
    # a structural what-if (remove) drops the arrays: simulate rebuilds them from networkx
    secs = float("inf")
    for _ in range(args.repeat):
        h = g.remove("launch0")
        t0 = time.perf_counter()
        tl = simulate(h)
        secs = min(secs, time.perf_counter() - t0)
    report("simulate (first call after remove())", secs, tl)
    secs, tl = _best(lambda: simulate(g, Contention()), args.repeat)
    report("simulate with Contention()", secs, tl)


if __name__ == "__main__":
    main()
