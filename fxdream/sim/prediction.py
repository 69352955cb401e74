"""fxdream.simulate(): capture → (passes) → lower → simulate, for this machine or any DeviceSpec."""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from fxdream.capturing.captured import Captured
from fxdream.capturing.host_gaps import StepCalls
from fxdream.sim.cost.devices import DEVICES, DeviceSpec
from fxdream.sim.cost.model import CostModel
from fxdream.sim.cost.profiled import Profiled
from fxdream.sim.cost.spread import SpreadBound
from fxdream.sim.lower import lower, lower_captured
from fxdream.sim.optimizer_step import OptimizerModel
from fxdream.sim.simulate import Contention, Timeline
from fxdream.sim.simulate import simulate as simulate_graph
from fxdream.sim.taskgraph import TaskGraph, TaskKind


@dataclass(frozen=True)
class Prediction:
    """A simulated iteration (predicted, never measured): timeline, task graph and device."""
    device: DeviceSpec
    training: bool
    task_graph: TaskGraph
    timeline: Timeline
    static_bytes: int
    passes: tuple = ()  # PassReport rows when predicted with passes (simulate(..., passes=...))
    notes: tuple = ()   # e.g. the measured host time outside the graphs it includes
    # (low, high) ms: simulated at the fast and the slow end of the measured costs (``SpreadBound``:
    # whole runs' spread, or each op's samples); with analytic costs, the time scaled by the
    # errors the device's fit had on the models it was checked on (``DeviceSpec.error_ratios``);
    # None where neither is known
    range_ms: tuple[float, float] | None = None
    # an inference call of a captured model, timed with calls back to back (``iteration_us``);
    # False: one iteration's makespan (a training step; a task graph given as one iteration)
    back_to_back: bool = False
    # the model's state no captured graph takes as input (eager code's, e.g. an RNN in training),
    # with its gradients and optimizer state in training: in the peak beside the timeline's memory
    outside_state_bytes: int = 0
    # of which gradients, in training, (parameter's qualified name, bytes) of each: the optimizer
    # step updates them too, and a data-parallel step reduces them (what-ifs on either need them)
    outside_gradients: tuple[tuple[str, int], ...] = ()
    # the graphs it was predicted from (``Captured``, a tuple after graph breaks): what-ifs that
    # rewrite graphs or read gradients (``whatif.amp``, ``ddp``) take them from here
    captured: Any = field(default=None, repr=False, compare=False)

    @functools.cached_property
    def time_ms(self) -> float:
        """Time per iteration: one iteration's makespan, or with ``back_to_back`` the time per
        call of calls run back to back (``iteration_us``; kept: it may simulate two calls)."""
        if not self.back_to_back:
            return self.timeline.makespan_us / 1e3
        return iteration_us(self.device, self.task_graph, self.timeline) / 1e3

    @property
    def outside_gradient_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.outside_gradients)

    @property
    def time_ms_range(self) -> tuple[float, float]:
        """(low, high) ms the iteration is predicted to take (``range_ms``); (time, time) where
        nothing says how far the prediction may err."""
        return self.range_ms if self.range_ms is not None else (self.time_ms, self.time_ms)

    @property
    def peak_memory_bytes(self) -> int:
        return self.timeline.peak_memory_bytes + self.outside_state_bytes

    @property
    def fits_in_memory(self) -> bool:
        """Whether the predicted peak fits in the device's memory (``DeviceSpec.memory_bytes``)."""
        return self.peak_memory_bytes <= self.device.memory_bytes

    def memory_verdict(self) -> str:
        """'fits in h100 memory (80 GiB)' or 'does not fit in ...': the predicted peak against it."""
        verb = "fits" if self.fits_in_memory else "does not fit"
        return f"{verb} in {self.device.name} memory ({self.device.memory_bytes / 2**30:.0f} GiB)"

    def _range_text(self) -> str:
        if self.range_ms is not None:
            return f" ({self.range_ms[0]:.3f}–{self.range_ms[1]:.3f})"
        if self.device.kind == "cuda" and self.device.error_ratios is None:
            return " (no range: no measurement of this GPU says how far its predictions err)"
        return ""

    def top_layers(self, n: int = 10) -> tuple[tuple[str, float], ...]:
        ranked = sorted(self.timeline.per_layer_us.items(), key=lambda kv: -kv[1])
        return tuple(ranked[:n])

    def summary(self, top: int = 10) -> str:
        mode = "training step" if self.training else "inference"
        lines = [f"predicted {mode} on {self.device.name}: {self.time_ms:.3f} ms{self._range_text()} per iteration, "
                 f"peak memory {self.peak_memory_bytes / 2**20:.1f} MiB, {self.memory_verdict()} "
                 f"({len(self.task_graph)} tasks)"]
        busy = ", ".join(f"{r} {self.timeline.utilization(r) * 100:.0f} %" for r in sorted(self.timeline.busy_us))
        lines.append(f"busy: {busy}")
        lines.append(f"top layers ({'GPU' if self.device.kind == 'cuda' else 'CPU'} time):")
        total = sum(self.timeline.per_layer_us.values()) or 1.0
        rows = [(layer or "(model)", us) for layer, us in self.top_layers(top)]
        width = max([40] + [len(name) for name, _ in rows])  # the ms column lines up under long names
        for name, us in rows:
            lines.append(f"  {name:<{width}} {us / 1e3:9.3f} ms  {100 * us / total:5.1f} %")
        lines += [f"note: {n}" for n in self.notes]
        if self.passes:
            lines.append("passes:")
            lines += [f"  {r.name} [{r.graph_index}/{r.phase}] {'applied' if r.applied else 'not applied'}: {r.reason}"
                      for r in self.passes]
        return "\n".join(lines)


def iteration_us(device: DeviceSpec, graph: TaskGraph | None, timeline: Timeline) -> float:
    """Time per iteration of iterations run back to back, as a loop over calls runs them and as
    fxdream times them. On a CPU the host runs the kernels: one iteration's makespan. On a GPU
    the host launches the next iteration while the device runs this one, so an iteration costs
    its busiest resource (the host's launches or a stream's kernels); where the host waits for
    the device within it (a SYNC task: ``.item()``), the next iteration's work before its wait
    overlaps only this one's device work after it: two iterations are simulated back to back
    (with contention, as predictions are by default) and the second's added time is one's."""
    if device.kind != "cuda" or graph is None:
        return timeline.makespan_us
    if any(t.kind is TaskKind.SYNC for t in graph.tasks):
        return simulate_graph(repeated(graph, 2), Contention()).makespan_us - timeline.makespan_us
    return min(timeline.makespan_us, max(timeline.busy_us.values(), default=0.0))


def repeated(graph: TaskGraph, times: int) -> TaskGraph:
    """``graph`` run ``times`` times back to back: copy k's tasks named "k|name" (copy 0 keeps
    the names), each resource's first task in copy k after its last in copy k - 1 (a host
    thread or a stream runs its work in program order, call after call)."""
    tasks = graph.tasks
    first, last = {}, {}
    for t in tasks:
        first.setdefault(t.resource, t.name)
        last[t.resource] = t.name
    out = TaskGraph()
    for k in range(times):
        name = (lambda n: n) if k == 0 else (lambda n, k=k: f"{k}|{n}")  # noqa: E731
        before = (lambda n: n) if k == 1 else (lambda n, k=k: f"{k - 1}|{n}")  # noqa: E731
        for t in tasks:
            out.add_task(dataclasses.replace(t, name=name(t.name)))
        for dep in graph.deps:
            out.add_dep(name(dep.src), name(dep.dst), dep.kind)
        if k:
            for resource, head in first.items():
                out.add_dep(before(last[resource]), name(head))
    return out


def this_machine_device(device: torch.device | str = "cpu") -> str:
    """The DeviceSpec name for where a module runs: "cpu", or the table's name of this GPU."""
    if torch.device(device).type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower()
    for key in DEVICES:
        if key != "cpu" and key in name:
            return key
    raise ValueError(f"no DeviceSpec for this GPU ({name}); valid: {', '.join(DEVICES)}")


def graph_prediction(gm, cost: CostModel, phase: str = "fw", contention: bool = True) -> tuple[float, int]:
    """(predicted µs, predicted peak bytes) of one graph on its own."""
    return _makespan_and_peak(lower([(f"g.{phase}", gm)], cost), contention)


def step_prediction(forward, backward, cost: CostModel, contention: bool = True) -> tuple[float, int]:
    """(predicted µs, predicted peak bytes) of a forward graph and its backward run as one step;
    of the backward alone where ``forward`` is None. On a GPU the host runs ahead: when the
    backward's host work starts, the forward's kernels are still queued, and host work a rewrite
    adds to the backward hides behind them. A backward predicted on its own starts from an empty
    queue and pays it in full (ResNet-50 training at batch 32 on an h100, aux_stream_backward:
    +72 µs alone, -319 µs in its step). Two backward candidates after the same forward differ as
    the whole steps do."""
    if forward is None:
        return graph_prediction(backward, cost, "bw", contention)
    return _makespan_and_peak(lower([("g.fw", forward), ("g.bw", backward)], cost), contention)


def _makespan_and_peak(lowered, contention: bool) -> tuple[float, int]:
    timeline = simulate_graph(lowered.graph, Contention() if contention else None,
                              initial_memory_bytes=lowered.static_bytes)
    return timeline.makespan_us, timeline.peak_memory_bytes


def predict(captured: Captured | tuple, cost: CostModel, training: bool,
            optimizer: OptimizerModel | None = None, graphs: dict | None = None,
            contention: bool = True, step: StepCalls | None = None) -> Prediction:
    """Lower and simulate already-captured graphs (``graphs`` replaces some by (index, phase));
    ``step``: the graph calls and host time of a measured step (``fxdream.host_gaps``)."""
    if isinstance(cost, Profiled):
        cost.profile_in_context(captured, graphs=graphs)

    def prediction(model: CostModel) -> Prediction:
        lowered = lower_captured(captured, model, optimizer if training else None, graphs, step)
        timeline = simulate_graph(lowered.graph, Contention() if contention else None,
                                  initial_memory_bytes=lowered.static_bytes)
        return Prediction(cost.device, training, lowered.graph, timeline, lowered.static_bytes,
                          back_to_back=not training, captured=captured)

    predicted = prediction(cost)
    if not isinstance(cost, Profiled):
        ratios = cost.device.error_ratios
        return predicted if ratios is None else dataclasses.replace(
            predicted, range_ms=(predicted.time_ms * ratios[0], predicted.time_ms * ratios[1]))
    low, high = (prediction(SpreadBound(cost, side)).time_ms for side in ("low", "high"))
    return dataclasses.replace(predicted, range_ms=(min(low, predicted.time_ms), max(high, predicted.time_ms)))
