"""fxdream.simulate(): capture → (passes) → lower → simulate, for this machine or any DeviceSpec."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from .capture import Captured, capture_with_host_gaps
from .host_gaps import StepCalls
from .sim.cost import Analytic, CostModel, Profiled
from .sim.devices import DeviceSpec, get_device
from .sim.profile_store import shared_profile
from .sim.lower import OPTIMIZERS, OptimizerModel, lower, lower_captured
from .sim.simulate import Contention, Timeline, simulate as simulate_graph
from .sim.taskgraph import TaskGraph


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

    @property
    def time_ms(self) -> float:
        return self.timeline.makespan_us / 1e3

    @property
    def peak_memory_bytes(self) -> int:
        return self.timeline.peak_memory_bytes

    def top_layers(self, n: int = 10) -> tuple[tuple[str, float], ...]:
        ranked = sorted(self.timeline.per_layer_us.items(), key=lambda kv: -kv[1])
        return tuple(ranked[:n])

    def summary(self, top: int = 10) -> str:
        mode = "training step" if self.training else "inference"
        lines = [f"predicted {mode} on {self.device.name}: {self.time_ms:.3f} ms per iteration, "
                 f"peak memory {self.peak_memory_bytes / 2**20:.1f} MiB "
                 f"({len(self.task_graph)} tasks)"]
        busy = ", ".join(f"{r} {self.timeline.utilization(r) * 100:.0f} %" for r in sorted(self.timeline.busy_us))
        lines.append(f"busy: {busy}")
        lines.append(f"top layers ({'GPU' if self.device.kind == 'cuda' else 'CPU'} time):")
        total = sum(self.timeline.per_layer_us.values()) or 1.0
        for layer, us in self.top_layers(top):
            lines.append(f"  {layer or '(model)':<40} {us / 1e3:9.3f} ms  {100 * us / total:5.1f} %")
        lines += [f"note: {n}" for n in self.notes]
        if self.passes:
            lines.append("passes:")
            lines += [f"  {r.name} [{r.graph_index}/{r.phase}] {'applied' if r.applied else 'not applied'}: {r.reason}"
                      for r in self.passes]
        return "\n".join(lines)


def cost_model_for(device: str | DeviceSpec, cost: str = "auto", reuse: bool = False) -> CostModel:
    """``profiled`` measures on this machine (needs the device here); ``analytic`` works for any.

    ``reuse``: a profiled model shares the process's measurements (``sim.profile_store``), so
    a rebuild does not time again what an earlier build timed; without it, it starts empty."""
    spec = device if isinstance(device, DeviceSpec) else get_device(device)
    runnable_here = spec.kind == "cpu" or (torch.cuda.is_available() and _is_this_gpu(spec))
    if cost == "auto":
        cost = "profiled" if runnable_here else "analytic"
    if cost == "analytic":
        return Analytic(spec)
    if cost == "profiled":
        if not runnable_here:
            raise ValueError(f"cost='profiled' measures on this machine, which has no {spec.name}; "
                             "use cost='analytic' (valid: 'profiled', 'analytic', 'auto')")
        torch_device = "cuda" if spec.kind == "cuda" else "cpu"
        return shared_profile(spec, torch_device) if reuse else Profiled(spec, torch_device)
    raise ValueError(f"cost={cost!r} is not a cost model; valid: 'profiled', 'analytic', 'auto'")


def _is_this_gpu(spec: DeviceSpec) -> bool:
    name = torch.cuda.get_device_name().lower()
    return spec.name.lower() in name


def this_machine_device(device: torch.device | str = "cpu") -> str:
    """The DeviceSpec name for where a module runs: "cpu", or the table's name of this GPU."""
    if torch.device(device).type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(torch.device(device)).lower()
    from .sim.devices import DEVICES
    for key in DEVICES:
        if key != "cpu" and key in name:
            return key
    raise ValueError(f"no DeviceSpec for this GPU ({name}); valid: {', '.join(DEVICES)}")


def graph_prediction(gm, cost: CostModel, phase: str = "fw", contention: bool = True) -> tuple[float, int]:
    """(predicted µs, predicted peak bytes) of one graph on its own."""
    lowered = lower([(f"g.{phase}", gm)], cost)
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
    lowered = lower_captured(captured, cost, optimizer if training else None, graphs, step)
    timeline = simulate_graph(lowered.graph, Contention() if contention else None,
                              initial_memory_bytes=lowered.static_bytes)
    return Prediction(cost.device, training, lowered.graph, timeline, lowered.static_bytes)


def simulate(model: torch.nn.Module, example_inputs, device: str | DeviceSpec = "cpu",
             training: bool = False, cost: str = "auto", optimizer: str | None = "sgd",
             contention: bool = True, passes=(), memory_budget: int | None = None) -> Prediction:
    """Predict one iteration of ``model`` on ``device`` (a DeviceSpec name such as "h100").

    Training includes backward and the optimizer step (``optimizer``: "sgd", "adam" or None).
    ``passes`` ("auto" or names) rewrite the captured graphs for ``device`` first (nothing runs
    there: a GPU works from a CPU machine); the rows say what each did (``.passes``).
    """
    if optimizer is not None and optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not known; valid: {', '.join(OPTIMIZERS)} or None")
    model_cost = cost_model_for(device, cost, reuse=True)
    # host time outside the graphs (graph breaks, autograd) is measured here: only for this machine
    captured, step, notes = capture_with_host_gaps(model, example_inputs, training,
                                                   measure=isinstance(model_cost, Profiled))
    if not passes:
        prediction = predict(captured, model_cost, training, OPTIMIZERS.get(optimizer),
                             contention=contention, step=step)
        return dataclasses.replace(prediction, notes=notes)
    from .plan import plan  # plan builds on predict
    planned = plan(model, captured, device, training, passes, model_cost, memory_budget,
                   OPTIMIZERS.get(optimizer), contention, step=step)
    return dataclasses.replace(planned.after, passes=planned.rows, notes=notes)
