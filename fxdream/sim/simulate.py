"""Event-driven simulation of a :class:`TaskGraph` -> :class:`Timeline`.

Semantics
---------
* Each resource (host thread ``cpu:N``, GPU stream ``stream:N``, channel ``comm:N``) runs one
  task at a time, without preemption.
* A task is *ready* when all its predecessors have finished.  It starts at
  ``max(ready time, time its resource becomes free)``: the simulator is work-conserving, a free
  resource never waits for a task that is not ready yet.
* Tie-break: among tasks ready on the same resource when it becomes free, the one added to the
  graph first (insertion order) starts first.  All completions at one instant are processed
  before any start at that instant, so the tie-break sees every task that became ready then.
* Dependencies are the only ordering besides that; kernels on different streams overlap freely
  unless contention is enabled.
* Memory: a task's ``mem_alloc`` is added when it starts and its ``mem_free`` subtracted when
  it ends, in simulated order, on top of ``initial_memory_bytes`` (e.g. the weights).  At one
  instant, the frees of tasks ending then come before the allocations of tasks starting then
  (the caching allocator can hand the block over); a zero-length task still allocates first.

Contention model (``Contention``)
---------------------------------
GPU-kind tasks running at the same time (on any streams) share one device: with
``U = sum(utilization)`` of the running kernels, each progresses at rate
``min(1, capacity / U)`` (``capacity`` defaults to 1.0: a device fully used by one kernel of
utilization 1).  So two utilization-1.0 kernels of 10 µs started together both end at 20 µs,
two of 0.5 both end at 10 µs.  It is processor sharing, implemented with remaining-work
bookkeeping: when the set of running kernels changes, remaining work is advanced and finishing
times are recomputed (stale finish events are skipped by a version number).

Cost: O((V + E) log V) with a heap of at most one running task per resource; no networkx call
in the inner loop: it runs on integer ids and adjacency lists that the graph builder keeps
(``TaskGraph._sim_arrays``).  ``benchmarks/sim_speed.py`` measures it.
"""
from __future__ import annotations

from dataclasses import dataclass
from heapq import heappop, heappush
from types import MappingProxyType
from typing import Mapping

from fxdream.sim.task_arrays import TaskArrays
from fxdream.sim.taskgraph import TaskGraph, TaskKind

OPTIMIZER_STEP = "(optimizer step)"  # per_layer_us's row of the optimizer's tasks, which no layer owns


@dataclass(frozen=True)
class Contention:
    """Share the GPU between concurrently running kernels (see module docstring).

    ``capacity``: total ``utilization`` the device sustains at full speed (1.0 = one kernel of
    utilization 1 saturates it)."""
    enabled: bool = True
    capacity: float = 1.0

    def __post_init__(self):
        if not self.capacity > 0:
            raise ValueError(f"Contention.capacity must be > 0, got {self.capacity}")


@dataclass(frozen=True)
class Timeline:
    """Result of :func:`simulate`; all times in µs from the start of the graph."""
    makespan_us: float
    times: Mapping[str, tuple[float, float]]   # task name -> (start, end)
    busy_us: Mapping[str, float]               # resource -> time it was running a task
    critical_path: tuple[str, ...]             # first task ... last-finishing task
    per_layer_us: Mapping[str, float]          # layer -> simulated GPU-kernel time (CPU-task
                                               # time if no GPU tasks); "" the model's own ops,
                                               # OPTIMIZER_STEP the optimizer's; host work around skipped
    peak_memory_bytes: int
    memory_curve: tuple[tuple[float, int], ...]  # (time, bytes) after each change, in order
    initial_memory_bytes: int = 0

    def start(self, name: str) -> float:
        return self.times[name][0]

    def end(self, name: str) -> float:
        return self.times[name][1]

    def duration(self, name: str) -> float:
        s, e = self.times[name]
        return e - s

    def utilization(self, resource: str) -> float:
        """Busy share of the makespan."""
        return self.busy_us.get(resource, 0.0) / self.makespan_us if self.makespan_us else 0.0


class _TimesView(Mapping):
    """Read-only ``name -> (start, end)`` over the simulator's arrays (no per-task tuples)."""
    __slots__ = ("_idx", "_names", "_start", "_end")

    def __init__(self, idx, names, start, end):
        self._idx, self._names, self._start, self._end = idx, names, start, end

    def __getitem__(self, name):
        i = self._idx[name]
        return self._start[i], self._end[i]

    def __iter__(self):
        return iter(self._names)

    def __len__(self):
        return len(self._names)

    def __repr__(self):
        return f"TimesView({len(self)} tasks)"


def _run_plain(c: TaskArrays):
    """Hot loop without contention: one event per task, a tiny event heap."""
    n, dur, res, succ, alloc, free = len(c.names), c.dur, c.res, c.succ, c.alloc, c.free
    has_mem = any(alloc) or any(free)
    indeg = list(c.indeg)
    nres = len(c.resources)
    start, end, rprev, trig = [0.0] * n, [0.0] * n, [-1] * n, [-1] * n
    ready = [[] for _ in range(nres)]   # per-resource heap of ready ids (id = insertion order)
    idle = [True] * nres
    last = [-1] * nres
    events: list = []                   # (end time, id) of running tasks
    mem: list = []
    done = 0
    for i in range(n):
        if not indeg[i]:
            ready[res[i]].append(i)     # ascending ids: already a heap
    t = 0.0
    touched = range(nres)
    while True:
        for r in touched:
            if idle[r]:
                q = ready[r]
                if q:
                    j = heappop(q)
                    idle[r] = False
                    start[j] = t
                    e = t + dur[j]
                    end[j] = e
                    rprev[j] = last[r]
                    last[r] = j
                    heappush(events, (e, j))
                    if has_mem and alloc[j]:
                        mem.append((t, alloc[j]))
        if not events:
            break
        t, i = heappop(events)
        touched = []
        while True:
            done += 1
            r = res[i]
            idle[r] = True
            touched.append(r)
            if has_mem and free[i]:
                mem.append((t, -free[i]))
            for s in succ[i]:
                k = indeg[s] - 1
                indeg[s] = k
                if not k:
                    trig[s] = i
                    rs = res[s]
                    heappush(ready[rs], s)
                    touched.append(rs)
            if events and events[0][0] == t:
                i = heappop(events)[1]
            else:
                break
    return start, end, rprev, trig, mem, done


class _SharedDevice:
    """Processor sharing of the device by the GPU tasks running at once: each progresses at
    ``rate`` = 1 while their utilizations sum to at most ``capacity``, else capacity / sum.
    ``ver[k]`` counts the finish times pushed for task k: an event with an older one is stale."""

    def __init__(self, capacity: float, dur: list, util: list):
        self.capacity, self.dur, self.util = capacity, dur, util
        self.ver = [0] * len(dur)
        self.running: dict[int, float] = {}  # task id -> remaining work (µs at full speed)
        self.u, self.rate, self.t_adv = 0.0, 1.0, 0.0  # sum of utilization, current rate, last advance

    def start(self, j: int, t: float, events: list) -> None:
        dt = (t - self.t_adv) * self.rate
        if dt and self.running:
            for k in self.running:
                self.running[k] -= dt
        self.t_adv = t
        self.running[j] = self.dur[j]
        self.u += self.util[j]
        if not self._rerate(t, events):
            heappush(events, (t + self.dur[j] / self.rate, j, self.ver[j]))

    def finish(self, i: int, t: float, events: list) -> None:
        dt = (t - self.t_adv) * self.rate
        self.t_adv = t
        del self.running[i]
        if self.running:
            self.u -= self.util[i]
            if dt:
                for k in self.running:
                    self.running[k] -= dt
        else:
            self.u = 0.0  # no drift across idle periods
        self._rerate(t, events)

    def _rerate(self, t: float, events: list) -> bool:
        """The rate for the current utilization; where it changed, every running task's finish
        time moves (pushed again with a new version): True."""
        new = 1.0 if self.u <= self.capacity else self.capacity / self.u
        if new == self.rate:
            return False
        self.rate = new
        for k, rem in self.running.items():
            self.ver[k] += 1
            heappush(events, (t + max(rem, 0.0) / new, k, self.ver[k]))
        return True


def _run_shared(c: TaskArrays, capacity: float):
    """General loop: GPU tasks progress at a shared rate (``_SharedDevice``)."""
    n, dur, res, succ, alloc, free = len(c.names), c.dur, c.res, c.succ, c.alloc, c.free
    shared = c.gpu
    device = _SharedDevice(capacity, dur, [t.utilization for t in c.tasks])
    ver = device.ver
    indeg = list(c.indeg)
    nres = len(c.resources)
    start, end, rprev, trig = [0.0] * n, [0.0] * n, [-1] * n, [-1] * n
    ready = [[] for _ in range(nres)]
    idle = [True] * nres
    last = [-1] * nres
    events: list = []                    # (finish time, id, version)
    mem: list = []
    for i in range(n):
        if not indeg[i]:
            ready[res[i]].append(i)
    t = 0.0
    touched = range(nres)
    while True:
        for r in touched:
            if idle[r] and ready[r]:
                j = heappop(ready[r])
                idle[r] = False
                start[j] = t
                rprev[j] = last[r]
                last[r] = j
                if alloc[j]:
                    mem.append((t, alloc[j]))
                if shared[j]:
                    device.start(j, t, events)
                else:
                    heappush(events, (t + dur[j], j, 0))
        while events and events[0][2] != ver[events[0][1]]:
            heappop(events)              # stale finish time of a shared task
        if not events:
            break
        t = events[0][0]
        touched = []
        while events and events[0][0] == t:
            _, i, v = heappop(events)
            if v != ver[i]:
                continue
            end[i] = t
            r = res[i]
            idle[r] = True
            touched.append(r)
            if free[i]:
                mem.append((t, -free[i]))
            if shared[i]:
                device.finish(i, t, events)
            for s in succ[i]:
                indeg[s] -= 1
                if not indeg[s]:
                    trig[s] = i
                    heappush(ready[res[s]], s)
                    touched.append(res[s])
    return start, end, rprev, trig, mem, n - sum(map(bool, indeg))


def simulate(graph: TaskGraph, contention: Contention | bool | None = None, *,
             initial_memory_bytes: int = 0) -> Timeline:
    """Simulate ``graph`` (semantics in the module docstring).  Raises ValueError on a cycle."""
    if contention is True:
        contention = Contention()
    c = graph._sim_arrays()  # integer ids + adjacency lists, kept by the graph builder
    if contention and contention.enabled:
        start, end, rprev, trig, mem, done = _run_shared(c, contention.capacity)
    else:
        start, end, rprev, trig, mem, done = _run_plain(c)
    if done < len(c.names):
        graph.validate()  # raises, naming the cycle
        raise RuntimeError(f"simulation stopped after {done}/{len(c.names)} tasks")
    return _timeline(c, start, end, rprev, trig, mem, int(initial_memory_bytes))


def _unlayered(task) -> str | None:
    """The per-layer row of a task no layer names: "" for an op of the model's own (in no submodule),
    ``OPTIMIZER_STEP`` for the optimizer's; None (no row) for host work around the ops (the
    calls between graphs, autograd's engine, a graph's launch)."""
    if task.phase == "optim":
        return OPTIMIZER_STEP
    return "" if task.fx_node is not None else None


def _timeline(c: TaskArrays, start, end, rprev, trig, mem, init) -> Timeline:
    names, tasks, res = c.names, c.tasks, c.res
    makespan = max(end, default=0.0)
    busy = [0.0] * len(c.resources)
    for r, s, e in zip(res, start, end):
        busy[r] += e - s
    if any(c.gpu):
        sel = [i for i, x in enumerate(c.gpu) if x]
    else:
        cpu = TaskKind.CPU
        sel = [i for i, t in enumerate(tasks) if t.kind is cpu]
    per_layer: dict[str, float] = {}
    layers = c.layer
    for i in sel:
        layer = layers[i] or _unlayered(tasks[i])
        if layer is not None:
            per_layer[layer] = per_layer.get(layer, 0.0) + end[i] - start[i]
    cur = peak = init
    curve = [(0.0, init)]
    for tm, d in mem:
        cur += d
        curve.append((tm, cur))
        if cur > peak:
            peak = cur
    return Timeline(
        makespan_us=makespan,
        times=_TimesView(c.idx.copy(), names.copy(), start, end),  # graph may grow later
        busy_us=MappingProxyType(dict(zip(c.resources, busy))),
        critical_path=_critical_path(names, start, end, rprev, trig),
        per_layer_us=MappingProxyType(per_layer),
        peak_memory_bytes=peak,
        memory_curve=tuple(curve),
        initial_memory_bytes=init,
    )


def _critical_path(names, start, end, rprev, trig) -> tuple[str, ...]:
    """Walk back from the last-finishing task through whatever determined each start: the
    dependency whose completion made it ready (the last one to finish), or the previous task on
    its resource if that ended later (the task waited for the resource)."""
    if not names:
        return ()
    makespan = max(end)
    cur = len(end) - 1 - end[::-1].index(makespan)  # last-added among the last to finish
    path = [cur]
    while True:
        d, r = trig[cur], rprev[cur]
        if r >= 0 and (d < 0 or end[r] > end[d]):
            d = r
        if d < 0:
            break  # a source task: nothing to wait for
        cur = d
        path.append(cur)
    return tuple(names[i] for i in reversed(path))
