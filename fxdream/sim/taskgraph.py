"""Daydream-style task graph: CPU/GPU/comm tasks, typed dependencies and what-if primitives.

A task runs on one *resource* (``"cpu:0"`` a host thread, ``"stream:0"`` a GPU stream,
``"comm:0"`` a network channel); a resource runs one task at a time.  Edges are the only
ordering besides that (see :mod:`fxdream.sim.simulate`), and insertion order is the tie-break
among tasks that are ready at once on one resource, so builders should add tasks in program
order.  The what-if primitives (``select``, ``scale``/``shrink``, ``insert``, ``remove``,
``remove_dep``, ``schedule``, ``reorder``, ``update``) never mutate: each returns a new graph.
Don't mutate ``TaskGraph.nx`` directly: the graph keeps an integer mirror for the simulator.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import networkx as nx

from fxdream.sim.task import SEQUENTIAL_DEPS, Dep, DepKind, Task, TaskKind, infer_dep_kind
from fxdream.sim.task_arrays import TaskArrays


def _names(names) -> tuple[str, ...]:
    return (names,) if isinstance(names, str) else tuple(names)


def _match_path(value: str, want: str, sep: str) -> bool:
    return value == want or value.startswith(want + sep)


class TaskGraph:
    """A DAG of :class:`Task` (networkx ``DiGraph``: node attr ``task``, edge attr ``kind``).

    Builder methods (``add_task``, ``add_dep``, ``append``) mutate in place; what-if primitives
    return new graphs.  ``nx`` exposes the DiGraph for analysis; treat it as read-only.
    """

    def __init__(self):
        self._g = nx.DiGraph()
        self._last: dict[str, str] = {}  # resource -> last task added on it (for append)
        self._arr: TaskArrays | None = TaskArrays()

    # ---- building ---------------------------------------------------------------------------
    def add_task(self, task: Task) -> str:
        if not isinstance(task, Task):
            raise TypeError(f"expected a Task, got {type(task).__name__}")
        if task.name in self._g._node:
            raise ValueError(f"duplicate task name {task.name!r}")
        self._g.add_node(task.name, task=task)
        self._last[task.resource] = task.name
        if self._arr is not None:
            self._arr.add(task)
        return task.name

    def add_dep(self, src: str, dst: str, kind: DepKind | str | None = None) -> None:
        """Add ``src -> dst``; ``kind`` defaults to :func:`infer_dep_kind`."""
        nodes = self._g._node
        for n in (src, dst):
            if n not in nodes:
                raise ValueError(f"unknown task {n!r} in dependency {src!r} -> {dst!r}")
        if src == dst:
            raise ValueError(f"self-dependency on task {src!r}")
        if kind is None:
            kind = infer_dep_kind(nodes[src]["task"], nodes[dst]["task"])
        else:
            kind = DepKind(kind)
        new_edge = dst not in self._g._succ[src]
        self._g.add_edge(src, dst, kind=kind)
        if new_edge and self._arr is not None:
            self._arr.link(src, dst)

    def append(self, task: Task, deps: Iterable = (), *,
               after_last_on_resource: bool = True) -> str:
        """Add ``task`` after the last task added on its resource (sequential edge), plus
        ``deps``: names (kind inferred) or ``(name, kind)`` pairs."""
        prev = self._last.get(task.resource) if after_last_on_resource else None
        self.add_task(task)
        if prev is not None and prev in self._g:
            self.add_dep(prev, task.name)
        for d in _names(deps):
            src, kind = (d, None) if isinstance(d, str) else d
            self.add_dep(src, task.name, kind)
        return task.name

    # ---- reading ----------------------------------------------------------------------------
    @property
    def nx(self) -> nx.DiGraph:
        return self._g

    @property
    def tasks(self) -> tuple[Task, ...]:
        """All tasks in insertion order (the simulator's tie-break order)."""
        return tuple(t for _, t in self._g.nodes(data="task"))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._g)

    @property
    def deps(self) -> tuple[Dep, ...]:
        return tuple(Dep(u, v, k) for u, v, k in self._g.edges(data="kind"))

    @property
    def resources(self) -> tuple[str, ...]:
        """Resources in order of first use."""
        return tuple(dict.fromkeys(t.resource for t in self.tasks))

    def task(self, name: str) -> Task:
        try:
            return self._g._node[name]["task"]
        except (KeyError, TypeError):
            raise ValueError(f"unknown task {name!r}") from None

    __getitem__ = task

    def __contains__(self, name) -> bool:
        return name in self._g

    def __iter__(self):
        return iter(self._g)

    def __len__(self) -> int:
        return len(self._g)

    def __repr__(self) -> str:
        return (f"TaskGraph({len(self)} tasks, {self._g.number_of_edges()} deps, "
                f"resources={list(self.resources)})")

    def dep_kind(self, src: str, dst: str) -> DepKind:
        self._check(src, dst)
        if not self._g.has_edge(src, dst):
            raise ValueError(f"no dependency {src!r} -> {dst!r}")
        return self._g.edges[src, dst]["kind"]

    def predecessors(self, name: str) -> tuple[str, ...]:
        self._check(name)
        return tuple(self._g.predecessors(name))

    def successors(self, name: str) -> tuple[str, ...]:
        self._check(name)
        return tuple(self._g.successors(name))

    def next_on_resource(self, name: str) -> str | None:
        """The task after ``name`` in its resource's program order (None: the last one)."""
        self._check(name)
        return next(iter(self._seq(name, self._g.successors(name), True)), None)

    def previous_on_resource(self, name: str) -> str | None:
        """The task before ``name`` in its resource's program order (None: the first one)."""
        self._check(name)
        return next(iter(self._seq(name, self._g.predecessors(name), False)), None)

    def last_on(self, resource: str) -> str | None:
        """The task ``append`` would chain after on ``resource``."""
        return self._last.get(resource)

    def validate(self) -> None:
        """Raise ValueError naming a cycle if the graph has one."""
        if not nx.is_directed_acyclic_graph(self._g):
            cycle = nx.find_cycle(self._g)
            raise ValueError("task graph has a cycle: " + " -> ".join(u for u, _ in cycle)
                             + f" -> {cycle[0][0]}")

    def copy(self) -> "TaskGraph":
        new = TaskGraph()
        new._g = self._g.copy()
        new._last = dict(self._last)
        new._arr = None if self._arr is None else self._arr.clone()
        return new

    def _sim_arrays(self) -> TaskArrays:
        """The integer-indexed mirror (built on demand; callers must not mutate it)."""
        if self._arr is None:
            self._arr = TaskArrays.of(self._g)
        return self._arr

    # ---- what-if primitives (each returns a new graph) --------------------------------------
    def select(self, predicate: Callable[[Task], bool] | None = None, *, layer: str | None = None,
               op: str | None = None, kind: TaskKind | str | None = None,
               resource: str | None = None, phase: str | None = None) -> tuple[str, ...]:
        """Names of tasks matching every given filter, in insertion order.

        ``layer`` and ``op`` match exactly or as a dotted prefix ("encoder" matches
        "encoder.0.conv"); ``resource`` exactly or as a prefix before ":" ("stream" matches every
        stream)."""
        kind = None if kind is None else TaskKind(kind.lower() if isinstance(kind, str) else kind)
        out = []
        for t in self.tasks:
            if ((kind is None or t.kind is kind)
                    and (layer is None or _match_path(t.layer, layer, "."))
                    and (op is None or _match_path(t.op, op, "."))
                    and (resource is None or _match_path(t.resource, resource, ":"))
                    and (phase is None or t.phase == phase)
                    and (predicate is None or predicate(t))):
                out.append(t.name)
        return tuple(out)

    def update(self, names, **changes) -> "TaskGraph":
        """New graph with ``Task.replace(**changes)`` applied to ``names`` (not the name)."""
        if "name" in changes or "resource" in changes:
            raise ValueError("update cannot rename tasks or move them (use schedule)")
        new = self.copy()
        for n in _names(names):
            new._set_task(new.task(n).replace(**changes))
        return new

    def scale(self, names, factor: float) -> "TaskGraph":
        """New graph with the durations of ``names`` multiplied by ``factor``.

        "The GPU is 2x faster" is ``g.scale(g.select(kind="gpu"), 0.5)``."""
        if not (factor >= 0 and math.isfinite(factor)):
            raise ValueError(f"scale factor must be finite and >= 0, got {factor}")
        new = self.copy()
        for n in _names(names):
            t = new.task(n)
            new._set_task(t.replace(duration_us=t.duration_us * factor))
        return new

    def shrink(self, names, factor: float) -> "TaskGraph":
        """Daydream's name for :meth:`scale` (same argument: ``shrink(names, 0.5)`` halves)."""
        return self.scale(names, factor)

    def insert(self, task: Task, after: Iterable[str] | str = (), before: Iterable[str] | str = (),
               kind: DepKind | str | None = None) -> "TaskGraph":
        """New graph with ``task`` between ``after`` and ``before`` (Daydream Insert(s, task, t)).

        Edge kinds are inferred unless ``kind`` is given.  A sequential edge ``s -> t`` on the
        task's own resource is replaced by ``s -> task -> t``, so the resource's chain stays a
        chain.  In tie-break order the task goes right after the last of ``after``."""
        after, before = _names(after), _names(before)
        new = self.copy()
        new._check(*after, *before)
        new.add_task(task)
        for s in after:
            new.add_dep(s, task.name, kind)
        for t in before:
            new.add_dep(task.name, t, kind)
        g, new._arr = new._g, None
        for s in after:
            for t in before:
                if (g.has_edge(s, t) and g.edges[s, t]["kind"] in SEQUENTIAL_DEPS
                        and new.task(s).resource == task.resource == new.task(t).resource):
                    g.remove_edge(s, t)
        order = [n for n in g if n != task.name]
        if after:
            pos = max(order.index(s) for s in after) + 1
        elif before:
            pos = min(order.index(t) for t in before)
        else:
            pos = len(order)
        order.insert(pos, task.name)
        return new._reordered(order)

    def remove(self, names) -> "TaskGraph":
        """New graph without ``names``; each removed task's predecessors are connected to its
        successors (kinds inferred, existing edges kept) so the remaining order is unchanged."""
        new = self.copy()
        g = new._g
        for n in _names(names):
            new._check(n)
            new._arr = None
            preds, succs = list(g.predecessors(n)), list(g.successors(n))
            g.remove_node(n)
            for p in preds:
                for s in succs:
                    if not g.has_edge(p, s):
                        g.add_edge(p, s, kind=infer_dep_kind(new.task(p), new.task(s)))
        new._refresh_last()
        return new

    def remove_dep(self, src: str, dst: str) -> "TaskGraph":
        """New graph without the edge ``src -> dst`` (e.g. "what if this sync went away")."""
        self.dep_kind(src, dst)  # raises if absent
        new = self.copy()
        new._g.remove_edge(src, dst)
        new._arr = None
        return new

    def schedule(self, name: str, resource: str, *, after: str | None = None,
                 keep_deps: bool = False) -> "TaskGraph":
        """New graph with ``name`` moved to another stream/thread.

        Its sequential edges on the old resource are bridged (predecessor -> successor), so the
        old resource keeps its order.  With ``keep_deps`` they become cross-resource edges
        (event/thread), i.e. the move alone overlaps nothing; by default they are dropped and the
        task may overlap its old neighbours (its other edges, e.g. its launch, stay).  ``after``
        places it in the new resource's chain right after that task."""
        new = self.copy()
        new._check(name)
        if new.task(name).resource == resource and after is None:
            return new  # already there
        old = new._detach(name)
        new._set_task(new.task(name).replace(resource=resource))
        if keep_deps:
            preds, succs = old
            for p in preds:
                new.add_dep(p, name)
            for s in succs:
                new.add_dep(name, s)
        if after is not None:
            return new._link(name, after=after, what="schedule")
        new._refresh_last()
        new._check_acyclic("schedule")
        return new

    def reorder(self, name: str, *, after: str | None = None,
                before: str | None = None) -> "TaskGraph":
        """New graph with ``name`` moved, within its resource's chain, right after ``after`` or
        right before ``before`` (exactly one)."""
        if (after is None) == (before is None):
            raise ValueError("reorder needs exactly one of after= or before=")
        new = self.copy()
        new._check(name)
        new._detach(name)
        return new._link(name, after=after, before=before)

    # ---- internals (on private copies only) -------------------------------------------------
    def _check(self, *names: str) -> None:
        for n in names:
            if n not in self._g:
                raise ValueError(f"unknown task {n!r}")

    def _set_task(self, task: Task) -> None:
        self._g._node[task.name]["task"] = task
        if self._arr is not None:
            self._arr.set(self._arr.idx[task.name], task)

    def _seq(self, name: str, nbrs: Iterable[str], outgoing: bool) -> list[str]:
        res, g = self.task(name).resource, self._g
        return [m for m in nbrs if self.task(m).resource == res and
                g.edges[(name, m) if outgoing else (m, name)]["kind"] in SEQUENTIAL_DEPS]

    def _detach(self, name: str) -> tuple[list[str], list[str]]:
        """Take ``name`` out of its resource chain, bridging its sequential neighbours."""
        g, self._arr = self._g, None
        preds = self._seq(name, g.predecessors(name), False)
        succs = self._seq(name, g.successors(name), True)
        for p in preds:
            g.remove_edge(p, name)
        for s in succs:
            g.remove_edge(name, s)
        for p in preds:
            for s in succs:
                if not g.has_edge(p, s):
                    g.add_edge(p, s, kind=infer_dep_kind(self.task(p), self.task(s)))
        return preds, succs

    def _link(self, name: str, *, after: str | None = None, before: str | None = None,
              what: str = "reorder") -> "TaskGraph":
        """Splice a detached task into its resource chain next to ``after``/``before``."""
        anchor = after if after is not None else before
        self._check(anchor)
        if anchor == name:
            raise ValueError(f"cannot place {name!r} relative to itself")
        res = self.task(name).resource
        if self.task(anchor).resource != res:
            raise ValueError(f"{anchor!r} runs on {self.task(anchor).resource!r}, "
                             f"not on {name!r}'s resource {res!r}")
        g, self._arr = self._g, None
        if after is not None:
            for s in self._seq(after, list(g.successors(after)), True):
                g.remove_edge(after, s)
                self.add_dep(name, s)
            self.add_dep(after, name)
        else:
            for p in self._seq(before, list(g.predecessors(before)), False):
                g.remove_edge(p, before)
                self.add_dep(p, name)
            self.add_dep(name, before)
        order = [n for n in g if n != name]
        pos = order.index(anchor) + (after is not None)
        order.insert(pos, name)
        new = self._reordered(order)
        new._check_acyclic(what)
        return new

    def _reordered(self, order: list[str]) -> "TaskGraph":
        new = TaskGraph()
        g = nx.DiGraph()
        g.add_nodes_from((n, self._g.nodes[n]) for n in order)
        g.add_edges_from(self._g.edges(data=True))
        new._g, new._arr = g, None
        new._refresh_last()
        return new

    def _refresh_last(self) -> None:
        self._last = {t.resource: t.name for t in self.tasks}

    def _check_acyclic(self, what: str) -> None:
        try:
            self.validate()
        except ValueError as e:
            raise ValueError(f"{what} would create a cycle: {e}") from None
