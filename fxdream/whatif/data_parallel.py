"""Data-parallel what-if, as ``DistributedDataParallel`` does it.

The gradients (the backward graph's outputs) are packed into buckets (first 1 MiB, then
25 MiB; a bucket closes once it reaches its cap, as DDP's ``compute_bucket_assignment_by_size``),
in the order the backward produces them (DDP rebuilds its buckets so after the first
iteration; ``bucket_order="reverse"``: reverse parameter order, its static assignment).  A
bucket's allreduce is a task on ``comm:0`` that starts once the backward has produced all its
gradients (CPU_TO_COMM from the host task that launched the producing kernel, EVENT from the
kernel, plus DDP's scaling copy into the bucket); allreduces run one at a time in bucket order,
and the optimizer waits for all of them (after DDP's copy back into ``.grad``).

Communication does not slow compute on a GPU (NIC/NVLink and copy engines; NCCL's use of SMs is
ignored); on a CPU device it takes host time instead (``overlap=False``: gloo's reduction runs
on the cores that compute).  DDP's flat bucket buffers add the gradients' bytes to static
memory.  Allreduce time: :class:`Cluster` (ring or hierarchical).

The simulator is deterministic, but ranks are not: every allreduce waits for the slowest
rank, so a step costs E[max over N ranks] of the step time, not its mean.  Given the spread of
one rank's step time (``step_jitter_ms``, σ), the simulated rank is made the slowest: its
backward runs σ·E[max of N standard normals] (:func:`expected_max_of_normals`) longer, and
the collectives follow it.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Mapping, Sequence

from fxdream.capturing.arguments import is_number
from fxdream.sim.cost.devices import DeviceSpec
from fxdream.sim.taskgraph import DepKind, Task, TaskGraph, TaskKind
from fxdream.whatif.core import WhatIf, _finish, _prediction, _start
from fxdream.whatif.gradients import Gradient, need_gradients

MiB = 2 ** 20


def ring_allreduce_us(nbytes: float, n: int, bandwidth: float, latency_us: float) -> float:
    """Ring allreduce of ``nbytes`` over ``n`` ranks: 2(n-1)/n · bytes/bandwidth + 2(n-1)·latency.

    ``bandwidth`` in bytes/s per link (NCCL's "bus bandwidth"), ``latency_us`` per ring step."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1 or nbytes <= 0:
        return 0.0
    transfer = 0.0 if math.isinf(bandwidth) else 2 * (n - 1) / n * nbytes / bandwidth * 1e6
    return transfer + 2 * (n - 1) * latency_us


def expected_max_of_normals(n: int) -> float:
    """E[max of ``n`` independent standard normals] (0 for one; 0.564 for two, 1.03 for four):
    the slowest of ``n`` ranks whose step times spread with σ = 1 comes that late on average."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if n == 1:
        return 0.0
    normal, step = statistics.NormalDist(), 0.005  # ∫ x · n φ(x) Φ(x)^(n-1) dx over ±10 σ
    xs = [-10 + i * step for i in range(int(20 / step) + 1)]
    return sum(x * n * normal.pdf(x) * normal.cdf(x) ** (n - 1) for x in xs) * step


@dataclass(frozen=True)
class Cluster:
    """``machines`` × ``gpus_per_machine`` ranks; NVLink inside a machine, a network between.

    ``topology="hierarchical"`` (default, 2-D allreduce; one NIC per machine): reduce-scatter
    inside each machine over NVLink, then the G shards allreduced across machines by G
    concurrent rings that share the machine's NIC, then allgather inside:
        T = 2(G-1)/G · S/B_nvlink + 2(N-1)/N · S/B_net + 2(G-1)·α_nvlink + 2(N-1)·α_net
    (G concurrent rings of S/G over a NIC of B_net move as much as one ring of S.)
    ``topology="ring"``: one flat ring over all N·G ranks, as fast as its slowest link:
        T = 2(n-1)/n · S / min(B) + 2(n-1) · max(α)   (the bottleneck model).
    Both reduce to :func:`ring_allreduce_us` on one machine (NVLink) or one GPU per machine
    (network).  Network figures are nominal: ``network_gbps`` in Gbit/s of achieved bandwidth.
    Defaults: NVLink bus bandwidth 360 GB/s (an NCCL allreduce figure on 8×H100 NVLink-4
    nodes; the link peak is 450 GB/s per direction), per-step latencies 3 µs (NVLink) and
    25 µs (TCP over Ethernet): estimates, set them for your system."""
    machines: int = 1
    gpus_per_machine: int = 1
    network_gbps: float = 10.0
    network_latency_us: float = 25.0
    nvlink_GBps: float = 360.0
    nvlink_latency_us: float = 3.0
    topology: str = "hierarchical"

    def __post_init__(self):
        for name in ("machines", "gpus_per_machine"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an integer, got {value!r}")
        for name in ("network_gbps", "network_latency_us", "nvlink_GBps", "nvlink_latency_us"):
            if not is_number(getattr(self, name)):
                raise TypeError(f"{name} must be a number, got {getattr(self, name)!r}")
        if self.machines < 1 or self.gpus_per_machine < 1:
            raise ValueError(f"machines and gpus_per_machine must be >= 1, got "
                             f"{self.machines} x {self.gpus_per_machine}")
        if not (self.network_gbps > 0 and self.nvlink_GBps > 0):
            raise ValueError("network_gbps and nvlink_GBps must be > 0 (math.inf allowed)")
        if self.network_latency_us < 0 or self.nvlink_latency_us < 0:
            raise ValueError("latencies must be >= 0")
        if self.topology not in ("hierarchical", "ring"):
            raise ValueError(f"topology={self.topology!r}; valid: 'hierarchical', 'ring'")

    @property
    def world_size(self) -> int:
        return self.machines * self.gpus_per_machine

    @property
    def network_Bps(self) -> float:
        return self.network_gbps * 1e9 / 8

    @property
    def nvlink_Bps(self) -> float:
        return self.nvlink_GBps * 1e9

    def allreduce_us(self, nbytes: float) -> float:
        n, g = self.machines, self.gpus_per_machine
        if self.topology == "ring":
            links = ([self.nvlink_Bps] if g > 1 else []) + ([self.network_Bps] if n > 1 else [])
            lats = ([self.nvlink_latency_us] if g > 1 else []) + ([self.network_latency_us] if n > 1 else [])
            if not links:
                return 0.0
            return ring_allreduce_us(nbytes, n * g, min(links), max(lats))
        # hierarchical: intra reduce-scatter + allgather = one intra ring allreduce's cost
        intra = ring_allreduce_us(nbytes, g, self.nvlink_Bps, self.nvlink_latency_us)
        inter = ring_allreduce_us(nbytes, n, self.network_Bps, self.network_latency_us)
        return intra + inter

    def describe(self) -> str:
        if self.machines == 1:
            return f"1x{self.gpus_per_machine} (NVLink {self.nvlink_GBps:g} GB/s)"
        return (f"{self.machines}x{self.gpus_per_machine} @ {self.network_gbps:g} Gbps "
                f"({self.topology})")


def check_cluster(cluster) -> None:
    if not isinstance(cluster, Cluster):
        raise TypeError(f"cluster must be a fxdream.whatif.Cluster (e.g. Cluster(machines=2, gpus_per_machine=8)), "
                        f"got {type(cluster).__name__}")


def ddp_buckets(grads: Sequence[Gradient], bucket_cap_mb: float = 25.0,
                first_bucket_mb: float = 1.0, ready_us: Mapping[int, float] | None = None
                ) -> tuple[tuple[Gradient, ...], ...]:
    """DDP's bucket assignment: a bucket closes as soon as it reaches its cap (the first
    bucket's cap is ``first_bucket_mb``; MiB as DDP counts).  Gradients in reverse parameter
    order, or, given ``ready_us`` (gradient index -> time it is produced), in the order they
    become ready, as DDP lays its buckets out again after the first iteration."""
    for name, value in (("bucket_cap_mb", bucket_cap_mb), ("first_bucket_mb", first_bucket_mb)):
        if not (is_number(value) and value > 0):
            raise ValueError(f"{name} must be a number of MiB > 0, got {value!r}")
    caps = [first_bucket_mb * MiB, bucket_cap_mb * MiB]
    order = list(reversed(list(grads)))
    if ready_us is not None:
        order.sort(key=lambda g: ready_us.get(g.index, 0.0))  # stable: ties stay reversed
    out, cur, size = [], [], 0
    for g in order:
        cur.append(g)
        size += g.nbytes
        if size >= caps[min(len(out), 1)]:
            out.append(tuple(cur))
            cur, size = [], 0
    if cur:
        out.append(tuple(cur))
    return tuple(out)


def _ready_times(grads: Sequence[Gradient], timeline, order: str) -> dict[int, float] | None:
    if order == "reverse":
        return None
    if order != "ready":
        raise ValueError(f"bucket_order={order!r}; valid: 'ready', 'reverse'")
    return {g.index: (timeline.end(g.producer) if g.producer else 0.0) for g in grads}


def _comm_deps(grads: Sequence[Gradient]) -> list:
    """CPU_TO_COMM from the host tasks that launched the producers, EVENT from the kernels."""
    deps = {}
    for g in grads:
        if g.launcher:
            deps[g.launcher] = DepKind.CPU_TO_COMM
        if g.producer and g.producer != g.launcher:
            deps[g.producer] = DepKind.EVENT
    return list(deps.items())


def _first_update(tg: TaskGraph) -> str | None:
    """The optimizer task that must wait for the gradients: its first kernel on a GPU (the
    stream waits, the host does not), its first host task on a CPU device (the host waits)."""
    kernels = tg.select(phase="optim", kind="gpu")
    if kernels:
        return kernels[0]
    host = tg.select(phase="optim")
    return host[0] if host else None


def _copy_task(name: str, like: Task, nbytes: float, spec: DeviceSpec) -> Task:
    """A memory-bound copy of ``nbytes`` (read + write counted) on ``like``'s resource."""
    us = spec.kernel_time_us(0, nbytes) if like.kind is TaskKind.GPU else nbytes / spec.mem_bandwidth * 1e6
    kind = TaskKind.GPU if like.kind is TaskKind.GPU else TaskKind.CPU
    return Task(name, kind, us, like.resource, op="ddp.copy", phase="comm")


def _slowest_rank(g: TaskGraph, grads: Sequence[Gradient], position: Mapping[str, int],
                  wait_us: float) -> tuple[TaskGraph, str | None]:
    """The simulated rank made the slowest: its backward runs ``wait_us`` longer (a task on the
    resource of the last gradient's producer, right after it), so every collective after it
    (and, with communication on the host, the host thread) starts that much later."""
    producers = [gr.producer for gr in grads if gr.producer]
    if wait_us <= 0 or not producers:
        return g.copy(), None
    last = max(producers, key=position.__getitem__)
    like = g.task(last)
    task = Task("ddp:slowest_rank", like.kind, wait_us, like.resource, op="ddp.slowest_rank", phase="bw")
    nxt = g.next_on_resource(last)
    return g.insert(task, after=[last], before=[nxt] if nxt else []), task.name


def ddp(x, cluster: Cluster, *, captured=None, graphs=None, bucket_cap_mb: float = 25.0,
        first_bucket_mb: float = 1.0, bucket_order: str = "ready", overlap: bool | None = None,
        copies: bool = True, gradient_as_bucket_view: bool = False, channel: str = "comm:0",
        contention: bool | None = None, step_jitter_ms: float = 0.0) -> WhatIf:
    """What if the training step ran data-parallel (DDP) on ``cluster``?  Bucketed ring
    allreduce overlapping the backward (module docstring); the optimizer waits for the last.

    ``overlap`` (default: True on a GPU, False on a CPU device): communication runs on its own
    ``channel``; False puts it on the host thread (``cpu:0``) instead, unchained, so it costs
    host time wherever the thread is free: a CPU's collectives (gloo: the reduction and, on one
    machine, the loopback copies) run on the same cores as the compute, and with every core
    computing they cannot overlap it.  ``copies``: DDP's gradient handling without a comm hook:
    each gradient is scaled into its bucket (read + write, one memory-bound task per bucket
    after its last gradient, on the producer's resource) and, unless
    ``gradient_as_bucket_view``, copied back after the last allreduce (one task before the
    optimizer).  ``bucket_order``: "ready" (gradients in the order the baseline produces
    them: DDP rebuilds its buckets so after its first iteration) or "reverse" (reverse
    parameter order, DDP's static assignment).  ``step_jitter_ms``: σ of one rank's step time;
    the step then waits for the slowest rank (module docstring)."""
    if not step_jitter_ms >= 0:
        raise ValueError(f"step_jitter_ms must be >= 0, got {step_jitter_ms}")
    check_cluster(cluster)
    s = _start(x, None, captured, graphs, contention)
    tg = s.current.task_graph
    spec = s.current.device
    grads = need_gradients(s, tg)
    buckets = ddp_buckets(grads, bucket_cap_mb, first_bucket_mb,
                          _ready_times(grads, s.current.timeline, bucket_order))
    overlap = spec.kind != "cpu" if overlap is None else overlap
    position = {n: i for i, n in enumerate(tg.names)}
    g, packs = _insert_packs(tg, buckets, position, spec) if copies else (tg, [None] * len(buckets))
    g, slowest = _slowest_rank(g, grads, position, step_jitter_ms * 1e3 * expected_max_of_normals(
        cluster.world_size))
    names, comm_us = _append_allreduces(g, buckets, packs, slowest, cluster, channel if overlap else None)
    total = sum(gr.nbytes for gr in grads)
    g, update = _step_after_allreduces(g, grads, names, position, spec, total, overlap,
                                       unpack=copies and not gradient_as_bucket_view)
    pred = _prediction(s.current, g, s.contention, static_bytes=s.current.static_bytes + total)
    last_bw_end = max((pred.timeline.end(n) for n in tg.select(phase="bw")), default=0.0)
    exposed = max(0.0, pred.timeline.end(names[-1]) - last_bw_end) if names else 0.0
    details = {"ddp.cluster": cluster.describe(), "ddp.world_size": cluster.world_size,
               "ddp.gradient_MB": total / 1e6, "ddp.buckets": len(buckets),
               "ddp.bucket_MB": [round(sum(gr.nbytes for gr in bk) / 1e6, 3) for bk in buckets],
               "ddp.bucket_bytes": [sum(gr.nbytes for gr in bk) for bk in buckets],
               "ddp.allreduce_ms_total": sum(comm_us) / 1e3,
               "ddp.comm_end_after_backward_ms": exposed / 1e3,
               "ddp.overlap": overlap, "ddp.copies": copies,
               "ddp.wait_slowest_rank_ms": g.task(slowest).duration_us / 1e3 if slowest else 0.0,
               # per-iteration time vs one GPU, and samples/s vs one GPU (weak scaling)
               "ddp.scaling_efficiency": s.current.time_ms / pred.time_ms if pred.time_ms else 1.0,
               "ddp.throughput_vs_one": cluster.world_size * s.current.time_ms / pred.time_ms
               if pred.time_ms else float(cluster.world_size)}
    return _finish(s, f"DDP {cluster.describe()}", g, details, prediction=pred)


def _insert_packs(g: TaskGraph, buckets, position: dict, spec) -> tuple[TaskGraph, list[str | None]]:
    """Each bucket's gradients scaled into it: one memory-bound task after its last gradient, on
    that gradient's resource. Returns the graph and each bucket's pack task (None: no producer)."""
    packs: list[str | None] = []
    for b, bucket in enumerate(buckets):
        producers = [gr.producer for gr in bucket if gr.producer]
        if not producers:
            packs.append(None)
            continue
        last = max(producers, key=position.__getitem__)
        task = _copy_task(f"ddp:pack:{b}", g.task(last), 2 * sum(gr.nbytes for gr in bucket), spec)
        nxt = g.next_on_resource(last)
        g = g.insert(task, after=[last], before=[nxt] if nxt else [])
        packs.append(task.name)
    return g, packs


def _append_allreduces(g: TaskGraph, buckets, packs: list, slowest: str | None, cluster: Cluster,
                       channel: str | None) -> tuple[list[str], list[float]]:
    """One allreduce per bucket, after its gradients (and pack), the last also after the slowest
    rank: on ``channel`` in bucket order, or (None) on the host thread, unchained. Returns the
    tasks' names and their µs."""
    names, comm_us = [], []
    for b, bucket in enumerate(buckets):
        us = cluster.allreduce_us(sum(gr.nbytes for gr in bucket))
        deps = _comm_deps(bucket) + ([(packs[b], None)] if packs[b] else [])
        if b == len(buckets) - 1 and slowest:
            deps.append((slowest, None))
        if channel is None:  # the collective's own thread: not the compute thread's program order
            deps = [(d, DepKind.SYNC if g.task(d).kind is TaskKind.GPU else DepKind.THREAD_TO_THREAD)
                    for d, _ in deps]
        kind = TaskKind.COMM if channel is not None else TaskKind.CPU
        names.append(g.append(Task(f"ddp:allreduce:{b}", kind, us, channel or "cpu:0", op="ddp.allreduce",
                                   phase="comm"), deps=deps, after_last_on_resource=channel is not None))
        comm_us.append(us)
    return names, comm_us


def _step_after_allreduces(g: TaskGraph, grads, names: list[str], position: dict, spec, total: int,
                           overlap: bool, unpack: bool) -> tuple[TaskGraph, str | None]:
    """The optimizer step waits for every allreduce (DDP's finalize_backward), after the copy of
    the averaged gradients back (``unpack``). Returns the graph and the step's first task."""
    update = _first_update(g)
    if names and unpack:
        like = g.task(update) if update else g.task(grads[0].producer or names[-1])
        task = _copy_task("ddp:unpack", like, 2 * total, spec)
        if update:
            prev = g.previous_on_resource(update)
            g = g.insert(task, after=[prev] if prev else [], before=[update])
        else:
            last = max((t for t in g.tasks if t.resource == task.resource and t.phase != "comm"),
                       key=lambda t: position.get(t.name, -1), default=None)
            g = g.insert(task, after=[last.name] if last else [])
        update = task.name
    if update is not None:
        wait = DepKind.EVENT if overlap else DepKind.THREAD_TO_THREAD
        for n in names:
            g.add_dep(n, update, DepKind.SYNC if g.task(update).kind is not TaskKind.GPU else wait)
    return g, update
