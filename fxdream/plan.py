"""What the passes would do for a device, without running anything there: a dry pipeline.

``plan`` runs the pass pipeline over already-captured graphs with a context that says
"this runs on ``device``" (a GPU spec works on a CPU machine: rewrites are lowered and
simulated, never executed) and returns the rows and the predicted before/after.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from fxdream.build import cost_model_for
from fxdream.capturing.captured import Captured, captured_parts
from fxdream.capturing.model_state import rng_kept
from fxdream.capturing.session import _model_state_of
from fxdream.pass_api import PassContext
from fxdream.pass_registry import available_passes, resolve_passes
from fxdream.pass_runner import PassPipeline
from fxdream.report import PassReport
from fxdream.sim.cost.model import CostModel
from fxdream.sim.cost.profiled import Profiled
from fxdream.sim.optimizer_step import OptimizerModel
from fxdream.sim.prediction import Prediction, predict


SETTLING_RUNS = 3  # pipeline runs after the first at most, each on the costs the one before it timed


@dataclass(frozen=True)
class Plan:
    device: str
    training: bool
    rows: tuple[PassReport, ...]
    before: Prediction
    after: Prediction
    graphs: dict = field(default_factory=dict, repr=False)  # (subgraph, phase) → rewritten graph

    @property
    def predicted_delta_pct(self) -> float:
        return 100.0 * (self.after.time_ms / self.before.time_ms - 1.0)

    def summary(self) -> str:
        lines = [f"predicted on {self.device}: {self.before.time_ms:.3f} ms without passes, "
                 f"{self.after.time_ms:.3f} ms with them ({self.predicted_delta_pct:+.1f} %), peak memory "
                 f"{self.before.peak_memory_bytes / 2**20:.1f} → {self.after.peak_memory_bytes / 2**20:.1f} MiB"]
        for row in self.rows:
            delta = "" if row.predicted_delta_us is None else f" (predicted {row.predicted_delta_us / 1e3:+.3f} ms)"
            lines.append(f"  {row.name} [{row.graph_index}/{row.phase}] "
                         f"{'applies' if row.applied else 'does not apply'}: {row.reason}{delta}")
            lines += [f"      {note}" for note in row.notes[:8]]
        return "\n".join(lines)


def _alias_key(t: torch.Tensor) -> tuple:
    """Tensors with equal keys are the same values (one storage, offset, shape, strides)."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def plan(model: torch.nn.Module, captured: Captured | tuple, device: str = "cpu", training: bool = False,
         passes="auto", cost: str | CostModel = "auto", memory_budget: int | None = None,
         optimizer: OptimizerModel | None = None, contention: bool = True, step=None) -> Plan:
    """Run ``passes`` ("auto" or names) over ``captured`` for ``device`` and simulate before/after
    (a training step with ``optimizer``'s step when given; ``step`` as ``predict`` takes it).
    The RNG is left as it was: measured costs time ops on random data."""
    with rng_kept(model):
        return _plan(model, captured, training, passes, cost_model_for(device, cost) if isinstance(cost, str) else cost,
                     memory_budget, optimizer, contention, step)


def _plan(model: torch.nn.Module, captured: Captured | tuple, training: bool, passes, cost_model: CostModel,
          memory_budget: int | None, optimizer: OptimizerModel | None, contention: bool, step) -> Plan:
    if isinstance(cost_model, Profiled):
        cost_model.profile_in_context(captured)
    selected = resolve_passes(available_passes() if passes == "auto" else passes)
    context = PassContext(device=cost_model.device.kind, training=training, sim_device=cost_model.device.name,
                          cost_model=cost_model, memory_budget=memory_budget)
    pipeline = _passes_run(model, captured, PassPipeline(selected, context, auto=passes == "auto"))
    for _ in range(SETTLING_RUNS if isinstance(cost_model, Profiled) else 0):
        # the rewrites' new ops were timed alone; timed in context now, the passes run again on those
        # costs, so each row says what the totals say. A run on them may choose another variant,
        # whose ops are then timed in context in turn: until no cost changes.
        revision = cost_model.revision
        cost_model.profile_in_context(captured, graphs=pipeline.rewritten)
        if cost_model.revision == revision:
            break
        pipeline = _passes_run(model, captured, PassPipeline(selected, context, auto=passes == "auto"))
    before = predict(captured, cost_model, training, optimizer, contention=contention, step=step)
    after = predict(captured, cost_model, training, optimizer, graphs=pipeline.rewritten, contention=contention,
                    step=step)
    return Plan(cost_model.device.name, training, tuple(pipeline.rows), before, after, dict(pipeline.rewritten))


def _passes_run(model: torch.nn.Module, captured: Captured | tuple, pipeline: PassPipeline) -> PassPipeline:
    """``pipeline`` run over every graph of ``captured``, each forward with the model's
    parameters and buffers it takes; returned for its rows and rewritten graphs."""
    owned = {_alias_key(t) for t in list(model.parameters()) + list(model.buffers())}
    for part in captured_parts(captured):
        # capture keeps its inputs detached (new tensor objects on the same storage): match storage
        state = [x if isinstance(x, torch.Tensor) and _alias_key(x) in owned else None
                 for x in part.example_inputs]
        for phase, gm in part.graphs():
            params = _model_state_of(gm, state) if phase == "fw" else {}
            pipeline(gm, phase, part.index, params, None)
    return pipeline
