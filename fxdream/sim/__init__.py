"""Daydream-style simulation: task graphs, what-if primitives, devices, traces.

Note: ``fxdream.sim.simulate`` is the function; import the module's other names directly
(``from fxdream.sim.simulate import Timeline``) or from this package.
"""
from fxdream.sim.cost.devices import DEVICES, DeviceSpec, calibrate_cpu, get_device
from fxdream.sim.simulate import Contention, Timeline, simulate
from fxdream.sim.taskgraph import Dep, DepKind, Task, TaskGraph, TaskKind, infer_dep_kind
from fxdream.sim.trace import plot_comparison, plot_timeline, to_chrome_trace, write_chrome_trace

__all__ = [
    "Task", "TaskKind", "DepKind", "Dep", "TaskGraph", "infer_dep_kind",
    "simulate", "Timeline", "Contention",
    "DeviceSpec", "DEVICES", "get_device", "calibrate_cpu",
    "to_chrome_trace", "write_chrome_trace", "plot_timeline", "plot_comparison",
]
