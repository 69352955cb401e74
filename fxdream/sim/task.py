"""The tasks of a Daydream task graph: kinds, dependency kinds and the Task record.

A task runs on one *resource* (``"cpu:0"``, ``"stream:0"``, ``"comm:0"``); a dependency's kind
says which of Daydream's six relations (plus cross-stream events and CUDA-graph launches) it is.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple


class TaskKind(str, Enum):
    CPU = "cpu"
    GPU = "gpu"
    COMM = "comm"
    SYNC = "sync"  # a host-side call that waits for the device (cudaDeviceSynchronize, .item())


class DepKind(str, Enum):
    CPU_SEQUENTIAL = "cpu_sequential"    # program order on one host thread (or comm channel)
    GPU_SAME_STREAM = "gpu_same_stream"  # program order on one GPU stream
    LAUNCH = "launch"                    # cpu launch -> gpu kernel
    SYNC = "sync"                        # gpu -> cpu (the cpu waits for the device)
    CPU_TO_COMM = "cpu_to_comm"
    THREAD_TO_THREAD = "thread_to_thread"
    EVENT = "event"                      # cross-stream event record -> wait
    GRAPH_LAUNCH = "graph_launch"        # one cpu task launching a CUDA graph's kernels


SEQUENTIAL_DEPS = frozenset({DepKind.CPU_SEQUENTIAL, DepKind.GPU_SAME_STREAM})
_HOST = (TaskKind.CPU, TaskKind.SYNC)


@dataclass(frozen=True)
class Task:
    """One unit of work on one resource; times in µs, memory in bytes."""
    name: str
    kind: TaskKind
    duration_us: float
    resource: str
    layer: str = ""
    op: str = ""
    fx_node: str | None = None
    mem_alloc: int = 0      # allocated when the task starts
    mem_free: int = 0       # freed when the task ends
    utilization: float = 1.0  # share of the device a GPU kernel can use (contention model)
    phase: str = ""         # "fw", "bw", "optim", ...

    def __post_init__(self):  # validation on the fast path: graphs have 100k tasks
        if type(self.name) is not str or not self.name:
            raise ValueError(f"task name must be a non-empty str, got {self.name!r}")
        if type(self.kind) is not TaskKind:
            object.__setattr__(self, "kind", TaskKind(self.kind))
        d = self.duration_us
        if type(d) is not float:
            d = float(d)
            object.__setattr__(self, "duration_us", d)
        if not 0.0 <= d < math.inf:
            raise ValueError(f"task {self.name!r}: duration_us must be finite and >= 0, got {d}")
        if type(self.resource) is not str or not self.resource:
            raise ValueError(f"task {self.name!r}: resource must be a non-empty str")
        if not 0.0 < self.utilization <= 1.0:
            raise ValueError(f"task {self.name!r}: utilization must be in (0, 1], "
                             f"got {self.utilization}")
        if self.mem_alloc < 0 or self.mem_free < 0:
            raise ValueError(f"task {self.name!r}: mem_alloc/mem_free must be >= 0")

    # Helper constructors: the resource is derived from a thread/stream/channel index.
    @classmethod
    def cpu(cls, name: str, duration_us: float, thread: int = 0, **kw) -> "Task":
        return cls(name, TaskKind.CPU, duration_us, f"cpu:{thread}", **kw)

    @classmethod
    def gpu(cls, name: str, duration_us: float, stream: int = 0, **kw) -> "Task":
        return cls(name, TaskKind.GPU, duration_us, f"stream:{stream}", **kw)

    @classmethod
    def comm(cls, name: str, duration_us: float, channel: int = 0, **kw) -> "Task":
        return cls(name, TaskKind.COMM, duration_us, f"comm:{channel}", **kw)

    @classmethod
    def sync(cls, name: str, duration_us: float = 0.0, thread: int = 0, **kw) -> "Task":
        return cls(name, TaskKind.SYNC, duration_us, f"cpu:{thread}", **kw)

    def replace(self, **changes) -> "Task":
        return dataclasses.replace(self, **changes)


class Dep(NamedTuple):
    src: str
    dst: str
    kind: DepKind


def infer_dep_kind(src: Task, dst: Task) -> DepKind:
    """The natural dependency kind between two tasks, from their kinds and resources."""
    if src.resource == dst.resource:
        both_gpu = src.kind is TaskKind.GPU and dst.kind is TaskKind.GPU
        return DepKind.GPU_SAME_STREAM if both_gpu else DepKind.CPU_SEQUENTIAL
    s_host, d_host = src.kind in _HOST, dst.kind in _HOST
    if s_host and d_host:
        return DepKind.THREAD_TO_THREAD
    if s_host:
        return DepKind.LAUNCH if dst.kind is TaskKind.GPU else DepKind.CPU_TO_COMM
    if d_host:
        return DepKind.SYNC  # the host waits for a kernel or a transfer
    return DepKind.EVENT     # device/comm -> device/comm across resources
