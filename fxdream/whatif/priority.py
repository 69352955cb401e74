"""P3 what-if: priority-based parameter propagation (Jayarajan et al., MLSys'19).

Gradients are cut into slices of ``slice_bytes`` (contiguous in forward parameter order); the
channel sends the ready slice of the earliest layer first (the simulator's tie-break on a
resource is insertion order: slices are inserted in priority order with no chain, so the channel
is a priority queue, non-preemptive per slice); each parameter is updated as soon as its slices
arrive, and the next iteration's forward op that first reads it waits only for that update.

Modelled as a two-iteration window: iteration 1's forward, backward and communication, then
iteration 2's forward with the updates interleaved before their first consumers.  The
per-iteration time is ``end(forward 2) - end(forward 1)``: exact for the periodic steady state
of this model, because forward 2 cannot end before all of iteration 1's communication has
arrived (every parameter is read in the forward), so backward 2 starts with no communication
pending, as backward 1 did.  DDP is evaluated in the same window (updates after the last
bucket) for the comparison (:func:`ddp_period`).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from fxdream.capturing.arguments import is_number
from fxdream.sim.optimizer_step import append_optimizer_step, optimizer_in
from fxdream.sim.prediction import Prediction
from fxdream.sim.taskgraph import SEQUENTIAL_DEPS, DepKind, Task, TaskGraph, TaskKind
from fxdream.whatif.core import WhatIf, _finish, _simulate, _Start, _start
from fxdream.whatif.data_parallel import Cluster, MiB, _comm_deps, _ready_times, check_cluster, ddp_buckets
from fxdream.whatif.gradients import Gradient, need_gradients


def _slices(grads: Sequence[Gradient], order: Sequence[Gradient], slice_bytes: int) -> list:
    """Cut the gradients, concatenated in ``order``, into slices of ``slice_bytes``:
    [(covered gradient indices, bytes)], in order."""
    out, cur, room = [], set(), slice_bytes
    for g in order:
        left = g.nbytes
        while left > 0:
            take = min(left, room)
            cur.add(g.index)
            left -= take
            room -= take
            if room == 0:
                out.append((frozenset(cur), slice_bytes))
                cur, room = set(), slice_bytes
    if cur:
        out.append((frozenset(cur), slice_bytes - room))
    return out


def _optimizer_tasks(tg: TaskGraph) -> dict[int, list[str]]:
    """Optimizer index -> its tasks (host task, then kernel), from the lowering's names."""
    out: dict[int, list[str]] = {}
    for n in tg.select(phase="optim"):
        parts = n.split(":")
        if len(parts) >= 2 and parts[0] == "optim" and parts[1].isdigit():
            out.setdefault(int(parts[1]), []).append(n)
    return out


def _updates_per_parameter(tg: TaskGraph, grads: Sequence[Gradient], device) -> TaskGraph:
    """``tg`` with its optimizer step as one update per parameter, as P3 applies them (each as
    its slices arrive), where the prediction's step updates them together (torch's multi-tensor
    ops on a GPU: ``foreach_ops`` tasks, whatever the number of parameters, so their count says
    nothing). A fused step stays as it is: it cannot update one parameter alone; a CPU's step is
    one update per parameter already."""
    optim, model, on_gpu = optimizer_in(tg)
    if model is None or model.fused or not (on_gpu and model.foreach):
        return tg
    per_parameter = tg.remove(optim)
    append_optimizer_step(per_parameter, [(gr.nbytes, 0) for gr in sorted(grads, key=lambda gr: gr.index)],
                          device, dataclasses.replace(model, foreach=False), on_gpu)
    return per_parameter


def _two_iterations(tg: TaskGraph, grads: Sequence[Gradient], comms: Sequence[tuple],
                    cluster: Cluster, channel: str, priority: bool) -> tuple[TaskGraph, list[str]]:
    """Iteration 1 (fw, bw, communication) + iteration 2's forward with the updates; returns the
    window's graph and iteration 1's forward tasks.

    ``comms``: [(covered gradient indices, bytes)] in insertion order.  ``priority``: P3 (no
    chain on the channel; each update waits for its own slices and sits before its first
    forward consumer); else DDP (a FIFO chain; all updates, as a block, wait for the last)."""
    optim = set(tg.select(phase="optim"))
    updates = _optimizer_tasks(tg)
    if optim and len(updates) < len(grads) and priority:
        raise ValueError("P3 needs one optimizer task per parameter; a fused optimizer updates "
                         "all of them at once")
    g = TaskGraph()
    for t in tg.tasks:
        if t.name not in optim:
            g.add_task(t)
    for d in tg.deps:
        if d.src not in optim and d.dst not in optim:
            g.add_dep(d.src, d.dst, d.kind)
    by_index = {gr.index: gr for gr in grads}
    slices_of: dict[int, list[str]] = {}
    names = []
    for k, (covered, nbytes) in enumerate(comms):
        task = Task(f"{'p3:slice' if priority else 'ddp:allreduce'}:{k}", TaskKind.COMM,
                    cluster.allreduce_us(nbytes), channel, op="p3.allreduce" if priority else "ddp.allreduce",
                    phase="comm")
        names.append(g.append(task, deps=_comm_deps([by_index[i] for i in sorted(covered)]),
                              after_last_on_resource=not priority))
        for i in covered:
            slices_of.setdefault(i, []).append(task.name)
    fw = [t for t in tg.tasks if t.phase == "fw"]
    fw_names = {t.name for t in fw}
    it2 = lambda n: f"it2:{n}"  # noqa: E731
    emitted: set[int] = set()

    def emit_update(i: int) -> None:
        emitted.add(i)
        waits = slices_of.get(i, []) if priority else names[-1:]
        tasks = updates.get(i, [])
        if not tasks:   # no optimizer in the prediction: the forward consumer waits itself
            return
        prev = None
        for n in tasks:
            t = tg.task(n)
            deps = [(it2(prev), DepKind.LAUNCH)] if prev and t.kind is TaskKind.GPU else []
            host_waits = t.kind is not TaskKind.GPU and not any(tg.task(m).kind is TaskKind.GPU for m in tasks)
            if t.kind is TaskKind.GPU or host_waits:
                deps += [(w, None) for w in waits]
            g.append(t.replace(name=it2(n)), deps=deps)
            prev = n

    position = {n: i for i, n in enumerate(tg.names)}
    first_consumer: dict[str, list[int]] = {}
    for gr in grads:
        firsts = [c for c in gr.consumers if c in fw_names]
        if firsts:
            first_consumer.setdefault(min(firsts, key=position.__getitem__), []).append(gr.index)
    if not priority:
        for i in sorted(updates):
            emit_update(i)
    for t in fw:
        extra = []
        for i in first_consumer.get(t.name, ()):
            if priority and i not in emitted:
                emit_update(i)
            if not updates.get(i):  # no optimizer: read the parameter once its slices are in
                extra += [(w, None) for w in (slices_of.get(i, []) if priority else names[-1:])]
        deps = [(it2(p), tg.dep_kind(p, t.name)) for p in tg.predecessors(t.name)
                if p in fw_names and tg.dep_kind(p, t.name) not in SEQUENTIAL_DEPS]
        g.append(t.replace(name=it2(t.name)), deps=deps + extra)
    for i in sorted(updates):
        if i not in emitted:
            emit_update(i)
    return g, [t.name for t in fw]


def _window_period(g: TaskGraph, fw1: Sequence[str], contention: bool, static: int):
    """The window's timeline and its steady-state period, end(forward 2) - end(forward 1)."""
    tl = _simulate(g, contention, static)
    end1 = max(tl.end(n) for n in fw1)
    end2 = max(tl.end(f"it2:{n}") for n in fw1)
    return tl, end2 - end1


def _ddp_comms(s: _Start, grads: Sequence[Gradient], bucket_cap_mb: float,
               first_bucket_mb: float) -> list:
    """DDP's buckets (in ready order) as [(covered gradient indices, bytes)] for the window."""
    return [(frozenset(gr.index for gr in bk), sum(gr.nbytes for gr in bk))
            for bk in ddp_buckets(grads, bucket_cap_mb, first_bucket_mb,
                                  _ready_times(grads, s.current.timeline, "ready"))]


def p3(x, cluster: Cluster, *, captured=None, graphs=None, slice_bytes: int = 4 * MiB,
       bucket_cap_mb: float = 25.0, first_bucket_mb: float = 1.0, channel: str = "comm:0",
       contention: bool | None = None) -> WhatIf:
    """What if gradients were sent by priority-based parameter propagation (P3)?

    Two-iteration window (module docstring); ``predicted_ms`` is the steady-state period,
    ``details`` also give DDP's period in the same window.  ``slice_bytes``: P3 slices
    (the paper's 50,000 parameters = 200 kB suit a parameter server; each ring allreduce
    pays 2(n-1) latencies, so larger slices are the default here)."""
    check_cluster(cluster)
    if not (is_number(slice_bytes) and slice_bytes >= 1):
        raise ValueError(f"slice_bytes must be a number of bytes >= 1, got {slice_bytes!r}")
    s = _start(x, None, captured, graphs, contention)
    tg = s.current.task_graph
    grads = need_gradients(s, tg)
    if not tg.select(phase="fw"):
        raise ValueError("P3 needs the forward's tasks (phase 'fw')")
    order_key = {}
    idx = {n: i for i, n in enumerate(tg.names)}
    for gr in grads:
        firsts = [idx[c] for c in gr.consumers if c in idx]
        order_key[gr.index] = (min(firsts) if firsts else len(idx), gr.index)
    forward_order = sorted(grads, key=lambda gr: order_key[gr.index])
    slices = _slices(grads, forward_order, int(slice_bytes))
    buckets = _ddp_comms(s, grads, bucket_cap_mb, first_bucket_mb)
    static = s.current.static_bytes + sum(gr.nbytes for gr in grads)
    g_p3, fw1 = _two_iterations(_updates_per_parameter(tg, grads, s.current.device), grads, slices, cluster,
                                channel, priority=True)
    g_ddp, _ = _two_iterations(tg, grads, buckets, cluster, channel, priority=False)
    tl_p3, period_p3 = _window_period(g_p3, fw1, s.contention, static)
    _, period_ddp = _window_period(g_ddp, fw1, s.contention, static)
    one_gpu = _one_gpu_period(s, tg, grads, buckets, channel, static)
    pred = Prediction(s.current.device, s.current.training, g_p3, tl_p3, static)
    details = {"p3.cluster": cluster.describe(), "p3.slices": len(slices),
               "one GPU's period ms (same window)": one_gpu / 1e3,
               "p3.slice_bytes": int(slice_bytes),
               "p3.allreduce_ms_total": sum(cluster.allreduce_us(b) for _, b in slices) / 1e3,
               "p3.ddp_period_ms (same window)": period_ddp / 1e3,
               "p3.window_makespan_ms": tl_p3.makespan_us / 1e3}
    return _finish(s, f"P3 {cluster.describe()}", g_p3, details, predicted_ms=period_p3 / 1e3,
                   prediction=pred, compared_with_ms=one_gpu / 1e3)


def ddp_period(x, cluster: Cluster, *, captured=None, graphs=None, bucket_cap_mb: float = 25.0,
               first_bucket_mb: float = 1.0, channel: str = "comm:0",
               contention: bool | None = None) -> WhatIf:
    """DDP's steady-state period in P3's two-iteration window (for like-for-like comparison;
    :func:`ddp` predicts one isolated iteration)."""
    s = _start(x, None, captured, graphs, contention)
    tg = s.current.task_graph
    grads = need_gradients(s, tg)
    buckets = _ddp_comms(s, grads, bucket_cap_mb, first_bucket_mb)
    static = s.current.static_bytes + sum(gr.nbytes for gr in grads)
    g, fw1 = _two_iterations(tg, grads, buckets, cluster, channel, priority=False)
    tl, period = _window_period(g, fw1, s.contention, static)
    pred = Prediction(s.current.device, s.current.training, g, tl, static)
    one_gpu = _one_gpu_period(s, tg, grads, buckets, channel, static)
    return _finish(s, f"DDP (window) {cluster.describe()}", g,
                   {"ddp.buckets": len(buckets), "one GPU's period ms (same window)": one_gpu / 1e3},
                   predicted_ms=period / 1e3, prediction=pred, compared_with_ms=one_gpu / 1e3)


def _one_gpu_period(s: _Start, tg: TaskGraph, grads: Sequence[Gradient], buckets: list, channel: str,
                    static: int) -> float:
    """The steady-state period of one GPU (no communication) in the same two-iteration window:
    what a period is compared with, as a step's makespan pays the host's start-up once where a
    training loop's steps overlap it with the previous step's kernels."""
    alone, fw1 = _two_iterations(tg, grads, buckets, Cluster(1, 1), channel, priority=False)
    return _window_period(alone, fw1, s.contention, static)[1]
