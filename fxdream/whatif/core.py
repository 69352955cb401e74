"""What-if plumbing: the result types and the steps every scenario shares.

Every scenario starts with :func:`_start` (a Prediction, a TaskGraph or a previous
:class:`WhatIf`, so scenarios chain), edits the task graph and ends with :func:`_finish`, which
simulates it again.  Also the one scenario too small for its own module, :func:`faster_gpu`.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import torch.fx as fx

from fxdream.capturing.arguments import is_number
from fxdream.capturing.captured import captured_parts
from fxdream.ir.nodes import is_view
from fxdream.sim.cost.devices import DeviceSpec, get_device
from fxdream.sim.prediction import Prediction
from fxdream.sim.simulate import Contention, simulate
from fxdream.sim.taskgraph import TaskGraph


# ---- results ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Measured:
    """Wall-clock times measured on this machine (never simulated): median ms per step."""
    baseline_ms: float
    scenario_ms: float
    how: str                 # what was timed, e.g. "eager training step, 1 thread, 5 rounds"
    device: str = "cpu"

    @property
    def speedup(self) -> float:
        return self.baseline_ms / self.scenario_ms if self.scenario_ms else math.inf


@dataclass(frozen=True)
class WhatIf:
    """A what-if scenario: the baseline and the scenario, both *predicted* by simulation.

    Reads like a :class:`Prediction` (``time_ms``, ``task_graph``, ``timeline``, ...): those are
    the scenario's.  ``measured`` is separate and set only where the scenario ran here."""
    scenario: str
    baseline: Prediction           # predicted: the graph as given
    predicted: Prediction          # predicted: the graph after the what-if
    predicted_ms: float            # predicted time per iteration of the scenario
    details: Mapping[str, Any] = field(default_factory=dict)
    measured: Measured | None = None
    contention: bool = True
    captured: Any = field(default=None, repr=False, compare=False)
    graphs: Any = field(default=None, repr=False, compare=False)
    # predicted: what the scenario is compared with where that is not the baseline's one step (a
    # steady-state period in a two-iteration window is compared with one GPU's in the same window)
    compared_with_ms: float | None = None

    def __post_init__(self):
        object.__setattr__(self, "details", MappingProxyType(dict(self.details)))

    # Prediction-like surface (the scenario's)
    @property
    def time_ms(self) -> float:
        return self.predicted_ms

    @property
    def time_ms_range(self) -> tuple[float, float]:
        """(low, high) ms: the baseline's range relative to its time, carried to the scenario's
        (both are costed by the same model, the scenario's tasks from the baseline's)."""
        low, high = self.baseline.time_ms_range
        if not self.baseline_ms:
            return (self.time_ms, self.time_ms)
        return (self.time_ms * low / self.baseline_ms, self.time_ms * high / self.baseline_ms)

    @property
    def baseline_ms(self) -> float:
        """What the scenario's time is compared with: the baseline's step, or ``compared_with_ms``."""
        return self.baseline.time_ms if self.compared_with_ms is None else self.compared_with_ms

    @property
    def predicted_speedup(self) -> float:
        return self.baseline_ms / self.time_ms if self.time_ms else math.inf

    @property
    def task_graph(self) -> TaskGraph:
        return self.predicted.task_graph

    @property
    def timeline(self):
        return self.predicted.timeline

    @property
    def device(self) -> DeviceSpec:
        return self.predicted.device

    @property
    def training(self) -> bool:
        return self.predicted.training

    @property
    def peak_memory_bytes(self) -> int:
        return self.predicted.peak_memory_bytes

    def with_measurement(self, measured: Measured) -> "WhatIf":
        return dataclasses.replace(self, measured=measured)

    def summary(self) -> str:
        lines = [f"what-if {self.scenario} on {self.device.name} (PREDICTED, simulated): "
                 f"{self.baseline_ms:.3f} ms -> {self.time_ms:.3f} ms per iteration "
                 f"({self.predicted_speedup:.2f}x)"]
        for k, v in self.details.items():
            lines.append(f"  {k}: {_fmt(v)}")
        m = self.measured
        if m is not None:
            lines.append(f"  MEASURED on this machine ({m.device}; {m.how}): {m.baseline_ms:.3f} ms -> "
                         f"{m.scenario_ms:.3f} ms ({m.speedup:.2f}x)")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        out = dict(scenario=self.scenario, device=self.device.name,
                   predicted_baseline_ms=self.baseline_ms, predicted_ms=self.time_ms,
                   predicted_speedup=self.predicted_speedup,
                   details={k: _plain(v) for k, v in self.details.items()})
        if self.measured is not None:
            out["measured"] = dict(dataclasses.asdict(self.measured), speedup=self.measured.speedup)
        return out


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _plain(v):
    if isinstance(v, (tuple, list)):
        return [_plain(x) for x in v]
    if isinstance(v, Mapping):
        return {str(k): _plain(x) for k, x in v.items()}
    return v


# ---- common plumbing -------------------------------------------------------------------------
_UNSPECIFIED = DeviceSpec("unspecified", "cuda", {"float32": 1.0}, 1.0, 0.0, 0.0, 0.0, None, 0)


def _spec(device) -> DeviceSpec | None:
    if device is None or isinstance(device, DeviceSpec):
        return device
    return get_device(device)


def _simulate(tg: TaskGraph, contention: bool, static_bytes: int):
    return simulate(tg, Contention() if contention else None, initial_memory_bytes=static_bytes)


def _prediction(like: Prediction, tg: TaskGraph, contention: bool, *, device: DeviceSpec | None = None,
                static_bytes: int | None = None) -> Prediction:
    static = like.static_bytes if static_bytes is None else static_bytes
    return Prediction(device or like.device, like.training, tg, _simulate(tg, contention, static), static,
                      back_to_back=like.back_to_back, outside_state_bytes=like.outside_state_bytes,
                      outside_gradients=like.outside_gradients, captured=like.captured)


@dataclass(frozen=True)
class _Start:
    baseline: Prediction
    current: Prediction
    scenario: str            # the scenarios applied so far ("" for none)
    details: dict
    captured: Any
    graphs: Any
    contention: bool


def _start(x, device=None, captured=None, graphs=None, contention: bool | None = None) -> _Start:
    """Normalise the what-if input: a Prediction, a TaskGraph or a previous WhatIf."""
    if isinstance(x, WhatIf):
        c = x.contention if contention is None else contention
        return _Start(x.baseline, x.predicted, x.scenario, dict(x.details),
                      captured if captured is not None else x.captured,
                      graphs if graphs is not None else x.graphs, c)
    c = True if contention is None else contention
    if isinstance(x, Prediction):
        # re-simulate the baseline under the same contention setting as the scenario
        base = _prediction(x, x.task_graph, c, device=_spec(device) or x.device)
        if x.range_ms is not None and x.time_ms:  # its range, relative to its time, as given
            base = dataclasses.replace(base, range_ms=tuple(base.time_ms * end / x.time_ms for end in x.range_ms))
        return _Start(base, base, "", {}, captured if captured is not None else x.captured, graphs, c)
    if isinstance(x, TaskGraph):
        spec = _spec(device) or _UNSPECIFIED
        training = any(t.phase in ("bw", "optim") for t in x.tasks)
        base = Prediction(spec, training, x, _simulate(x, c, 0), 0)
        return _Start(base, base, "", {}, captured, graphs, c)
    raise TypeError(f"expected a Prediction, WhatIf or TaskGraph, got {type(x).__name__}")


def _finish(s: _Start, name: str, tg: TaskGraph, details: dict, *, device: DeviceSpec | None = None,
            static_bytes: int | None = None, predicted_ms: float | None = None,
            prediction: Prediction | None = None, compared_with_ms: float | None = None) -> WhatIf:
    pred = prediction or _prediction(s.current, tg, s.contention, device=device, static_bytes=static_bytes)
    scenario = f"{s.scenario} + {name}" if s.scenario else name
    merged = {**s.details, **details}
    return WhatIf(scenario, s.baseline, pred, pred.time_ms if predicted_ms is None else predicted_ms,
                  merged, None, s.contention, s.captured, s.graphs, compared_with_ms)


def _with_durations(tg: TaskGraph, durations: Mapping[str, float]) -> TaskGraph:
    """A new graph with per-task durations (one rebuild instead of one ``update`` per task;
    equivalent to ``tg.update(name, duration_us=d)`` for every entry)."""
    if not durations:
        return tg
    new = TaskGraph()
    for t in tg.tasks:
        d = durations.get(t.name)
        new.add_task(t if d is None else t.replace(duration_us=d))
    for dep in tg.deps:
        new.add_dep(dep.src, dep.dst, dep.kind)
    return new


def _graphs_by_label(captured, graphs=None) -> dict[str, fx.GraphModule]:
    """Lowering labels ("g0.fw", "g0.bw") -> the GraphModule lowered under that label."""
    out = {}
    for c in captured_parts(captured):
        for phase, gm in c.graphs():
            out[f"g{c.index}.{phase}"] = (graphs or {}).get((c.index, phase), gm)
    return out


def graph_label(call_label: str) -> str:
    """The captured graph a lowered call ran: "g0#2.fw" (the third call of g0's forward) → "g0.fw"."""
    scope, _, phase = call_label.rpartition(".")
    return f"{scope.split('#', 1)[0]}.{phase}"


def call_scopes(task_graph: TaskGraph) -> dict[int, list[str]]:
    """Subgraph index → the scopes of its calls in ``task_graph`` ("g0", "g0#1", ...; a graph
    called once per layer of a step is lowered once per call), "g<index>" first. Read in one
    pass over the tasks; a subgraph with no task has no entry (its one call: ``[f"g{index}"]``)."""
    repeats: dict[int, list[int]] = {}
    for task in task_graph.tasks:
        scope = task.name.split(":", 1)[0].rpartition(".")[0]
        graph, _, call = scope.partition("#")
        if graph[:1] == "g" and graph[1:].isdigit():
            calls = repeats.setdefault(int(graph[1:]), [])
            if call.isdigit() and int(call) not in calls:
                calls.append(int(call))
    return {index: [f"g{index}", *(f"g{index}#{k}" for k in sorted(calls))] for index, calls in repeats.items()}


def _through_views(node: fx.Node) -> fx.Node:
    """The tensor a chain of views reads (a parameter behind its transpose, say)."""
    while node.op == "call_function" and is_view(node) and node.all_input_nodes:
        node = node.all_input_nodes[0]
    return node


# ---- a faster GPU ----------------------------------------------------------------------------
def faster_gpu(x, factor: float = 2.0, *, contention: bool | None = None) -> WhatIf:
    """What if every GPU kernel ran ``factor`` times faster?  Every GPU-kind task scaled by
    ``1/factor``; host tasks (dispatch, launch) unchanged."""
    if not (is_number(factor) and factor > 0 and math.isfinite(factor)):
        raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
    s = _start(x, contention=contention)
    tg = s.current.task_graph
    kernels = tg.select(kind="gpu")
    if not kernels:
        raise ValueError(f"the prediction for {s.current.device.name!r} has no GPU kernel tasks; "
                         "predict for a GPU DeviceSpec (e.g. device='h100')")
    return _finish(s, f"{factor:g}x faster GPU", tg.scale(kernels, 1.0 / factor),
                   {"faster_gpu.kernels_scaled": len(kernels)})
