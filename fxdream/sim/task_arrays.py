"""The simulator's flat view of a task graph: integer ids, parallel arrays, adjacency lists.

Kept current by ``TaskGraph``'s builder methods (while each task is hot in cache); the
simulator (:mod:`fxdream.sim.simulate`) walks it instead of networkx's dicts.
"""
from __future__ import annotations

import networkx as nx

from fxdream.sim.task import Task, TaskKind


class TaskArrays:
    """Integer-indexed mirror of a graph for the simulator (id = insertion order).

    Builder methods keep it current while the task is hot in cache; converting 100k scattered
    networkx nodes afterwards costs more than simulating them.  Other mutations drop it and
    :meth:`TaskGraph._sim_arrays` rebuilds it."""
    __slots__ = ("names", "idx", "tasks", "dur", "res", "rid", "succ", "indeg", "alloc", "free",
                 "gpu", "layer")

    def __init__(self):
        self.names, self.idx, self.tasks, self.dur, self.res = [], {}, [], [], []
        self.rid: dict[str, int] = {}
        self.succ, self.indeg, self.alloc, self.free, self.gpu, self.layer = [], [], [], [], [], []

    @property
    def resources(self) -> list[str]:
        return list(self.rid)

    def add(self, t: Task) -> None:
        self.idx[t.name] = len(self.names)
        self.names.append(t.name)
        self.succ.append([])
        self.indeg.append(0)
        for lst in (self.tasks, self.dur, self.res, self.alloc, self.free, self.gpu, self.layer):
            lst.append(None)
        self.set(len(self.names) - 1, t)

    def set(self, i: int, t: Task) -> None:
        self.tasks[i], self.dur[i], self.alloc[i], self.free[i] = (t, t.duration_us,
                                                                   t.mem_alloc, t.mem_free)
        self.gpu[i], self.layer[i] = t.kind is TaskKind.GPU, t.layer
        rid = self.rid
        self.res[i] = rid[t.resource] if t.resource in rid else rid.setdefault(t.resource,
                                                                               len(rid))

    def link(self, src: str, dst: str) -> None:
        d, s = self.idx[dst], self.idx[src]
        self.succ[s] = self.succ[s] + [d]  # new list: inner lists are shared between clones
        self.indeg[d] += 1

    def clone(self) -> "TaskArrays":
        """Cheap copy: the outer lists are copied, the per-task successor lists shared."""
        new = TaskArrays.__new__(TaskArrays)
        for k in self.__slots__:
            v = getattr(self, k)
            setattr(new, k, v.copy())
        return new

    @classmethod
    def of(cls, g: nx.DiGraph) -> "TaskArrays":
        a = cls()
        nodes = g._node  # networkx internals: its views cost a call per access
        a.names = list(nodes)
        a.idx = idx = dict(zip(a.names, range(len(a.names))))
        a.tasks = [d["task"] for d in nodes.values()]
        dur, res, alloc, free, rid = a.dur, a.res, a.alloc, a.free, a.rid
        gpu, layer = a.gpu, a.layer
        gpu_kind = TaskKind.GPU
        for t in a.tasks:
            dur.append(t.duration_us)
            r = t.resource
            res.append(rid[r] if r in rid else rid.setdefault(r, len(rid)))
            alloc.append(t.mem_alloc)
            free.append(t.mem_free)
            gpu.append(t.kind is gpu_kind)
            layer.append(t.layer)
        a.succ = [[idx[s] for s in d] for d in g._succ.values()]
        a.indeg = [len(d) for d in g._pred.values()]
        return a
