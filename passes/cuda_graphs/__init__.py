"""cuda_graphs: capture the maximal static regions of a graph in CUDA graphs (apache/mxnet #19142).

1. Mark what cannot be captured (passes/mark_incompatible.py), each node with its reason.
2. Partition the rest greedily in graph order: extend the current region with each
   capturable node, flush it at a marked node (as tinygrad batches its graphs). A getitem
   stays with its producer; a region never holds half of a multi-output node.
3. Keep a region only if the simulator predicts it pays off: the graph is lowered with and
   without the region (lowering collapses a region's per-kernel launches into one graph
   launch, plus the copy of its inputs and the clone of its escaping outputs) on a GPU
   DeviceSpec, and the region must save more than ``min_gain_us``. Every region's predicted
   gain is in the notes, kept or not.
4. On CUDA, replace each kept region by a call to a ``CudaGraphRunner`` (fxdream/
   cuda_graph_runner.py), which captures it once per shape key and replays it.

Outputs: region outputs that leave the graph (directly or through views) are cloned by one
``clone_outputs`` call right after the runner, so no caller ever holds a buffer the next
replay overwrites; outputs consumed inside the graph (by eager ops or another region) are
not copied. ``CudaGraphs(clone_outputs=False)`` skips the clone and has the runner raise
``CudaGraphOutputOverwritten`` when a previous output is still held at the next replay.

Static inputs: placeholders that are the model's parameters or buffers (``ctx.params``)
and constants are read in place; the others (user inputs, results of eager ops, and
outputs of another region, which may run eagerly if its capture fails) are copied into the
graph's static buffers on every call (one batched copy).

Training: the forward and the backward graphs are captured separately (this pass runs on
each); autograd accumulates the backward's outputs into ``.grad`` outside our graphs, and
the optimizer step is not captured. The saved activations and the gradients leave their
graphs, so they are cloned; the prediction includes those copies and decides.

On a CPU device the pass marks and partitions, predicts the gain on a GPU DeviceSpec
(``ctx.sim_device`` if it names a GPU, else "h100"; the context's cost model if it is for
a GPU, else the analytic one) and returns the graph unchanged with the reason
"CUDA graphs need a CUDA device". ``predict_cuda_graph_gain`` gives the same prediction
for any captured graph, and ``annotate_regions`` the flat graph with region ids that
``fxdream.predict.graph_prediction`` lowers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.fx as fx

from fxdream.ir.nodes import is_view
from fxdream.pass_api import PassBase, PassContext, PassResult, copy_graph_module, register_pass
from fxdream.passes.cuda_graphs.partition import RunnerOptions, layer_of, partition, replace_regions
from fxdream.passes.mark_incompatible import mark_incompatible, marked_notes
from fxdream.runtime.cuda_graph_runner import MAX_SHAPES, CudaGraphFallback
from fxdream.sim.cost.analytic import Analytic
from fxdream.sim.cost.devices import get_device
from fxdream.sim.graph_regions import cuda_graph_regions, inline_cuda_graph_runners
from fxdream.sim.prediction import graph_prediction, this_machine_device

DEFAULT_GPU = "h100"
NEEDS_CUDA = "CUDA graphs need a CUDA device"


@dataclass(frozen=True)
class RegionPlan:
    """One candidate region: where it is, what it holds, its predicted gain, kept or why not."""
    region: int
    nodes: tuple[str, ...]
    first_layer: str
    last_layer: str
    kernels: int
    copied_inputs: int
    copied_bytes: int
    pool_bytes: int                  # predicted memory the captured graph holds
    predicted_gain_us: float | None  # predicted time saved by this region (others kept)
    kept: bool
    reason: str

    def describe(self) -> str:
        span = self.first_layer if self.first_layer == self.last_layer else f"{self.first_layer} … {self.last_layer}"
        gain = "" if self.predicted_gain_us is None else f", predicted gain {self.predicted_gain_us:.1f} µs"
        return (f"region {self.region} ({span}): {self.kernels} kernels, {self.copied_inputs} input(s) copied per "
                f"call ({self.copied_bytes / 2**10:.1f} KiB), graph memory {self.pool_bytes / 2**20:.2f} MiB "
                f"(predicted){gain}: {self.reason}")


class CudaGraphPrediction(NamedTuple):
    """Predicted time of one graph without and with its CUDA graphs, and the regions."""
    before_us: float
    after_us: float
    regions: tuple[RegionPlan, ...]

    @property
    def speedup(self) -> float:
        return self.before_us / self.after_us if self.after_us else 1.0

    @property
    def gain_pct(self) -> float:
        """Throughput gain, as the seed reports it ("+17 %" = 1.17x)."""
        return 100.0 * (self.speedup - 1.0)

    @property
    def memory_bytes(self) -> int:
        return sum(r.pool_bytes for r in self.regions if r.kept)


# --- planning (simulation decides) ---------------------------------------------------------

def _gpu_cost(ctx: PassContext):
    cost = ctx.cost_model
    if cost is not None and getattr(cost, "device", None) is not None and cost.device.kind == "cuda":
        return cost
    name = DEFAULT_GPU
    if ctx.sim_device:
        try:
            if get_device(ctx.sim_device).kind == "cuda":
                name = ctx.sim_device
        except ValueError:
            pass
    elif ctx.device == "cuda" and torch.cuda.is_available():
        try:
            name = this_machine_device("cuda")
        except ValueError:
            pass
    return Analytic(get_device(name))


def _static_names(gm: fx.GraphModule, ctx: PassContext, static_inputs=None) -> set[str]:
    names = set(ctx.params) if static_inputs is None else set(static_inputs)
    return {n.name for n in gm.graph.nodes if n.op == "placeholder" and n.name in names}


def plan(gm: fx.GraphModule, ctx: PassContext, cost, min_gain_us: float = 0.0, static_inputs=None,
         options: RunnerOptions = RunnerOptions()) -> tuple[dict, CudaGraphPrediction, list]:
    """Mark ``gm``, partition it, and predict each region's gain on ``cost``'s GPU.

    Returns (marked node → reason, the prediction, kept regions as (id, node names)).
    """
    marked = mark_incompatible(gm, ctx)
    static = _static_names(gm, ctx, static_inputs)
    candidates = [(i, [n.name for n in nodes]) for i, nodes in enumerate(partition(gm, marked))]
    phase = ctx.phase

    def predict(subset) -> tuple[float, object]:
        trial = replace_regions(copy_graph_module(gm), subset, static, options, phase)
        return graph_prediction(trial, cost, phase)[0], trial

    before_us = graph_prediction(gm, cost, phase)[0]
    shapes: dict[int, tuple] = {}
    reasons: dict[int, str] = {}
    eligible = []
    members = {region_id: set(names) for region_id, names in candidates}
    for region_id, names in candidates:
        nodes = [n for n in gm.graph.nodes if n.name in members[region_id]]
        if not any(not is_view(n) for n in nodes):
            reasons[region_id] = "skipped: no kernel to launch (views only)"
        elif any(isinstance(n.meta.get("val"), (tuple, list)) and any(u.name not in members[region_id]
                                                                          for u in n.users)
                 for n in nodes):
            reasons[region_id] = "skipped: a multi-output node's results are used outside the region"
        else:
            eligible.append((region_id, names))
    gains: dict[int, float] = {}
    if eligible:
        all_us, trial = predict(eligible)
        for region in cuda_graph_regions(inline_cuda_graph_runners(trial)).values():
            shapes[region.region] = (region.kernels, len(region.copied_inputs), region.copied_bytes,
                                     region.pool_bytes)
        for k, (region_id, _) in enumerate(eligible):
            others = eligible[:k] + eligible[k + 1:]
            without_us = predict(others)[0] if others else before_us
            gains[region_id] = without_us - all_us
    kept = [(r, names) for r, names in eligible if gains[r] > min_gain_us]
    for region_id, _ in eligible:
        reasons[region_id] = ("kept" if gains[region_id] > min_gain_us else
                              f"skipped: too small to pay off (predicted gain ≤ {min_gain_us:g} µs)")
    if not kept:
        after_us = before_us
    elif len(kept) == len(eligible):
        after_us = all_us
    else:
        after_us = predict(kept)[0]
    plans = []
    for region_id, names in candidates:
        nodes = [n for n in gm.graph.nodes if n.name in members[region_id]]
        kernels, copied, copied_bytes, pool = shapes.get(region_id, (sum(not is_view(n) for n in nodes), 0, 0, 0))
        plans.append(RegionPlan(region_id, tuple(names), layer_of(nodes[0]), layer_of(nodes[-1]), kernels, copied,
                                copied_bytes, pool, gains.get(region_id), region_id in dict(kept),
                                reasons[region_id]))
    return marked, CudaGraphPrediction(before_us, after_us, tuple(plans)), kept


def predict_cuda_graph_gain(graph, cost=None, *, training: bool = False, phase: str = "fw",
                            static_inputs=None, min_gain_us: float = 0.0) -> CudaGraphPrediction:
    """Predict ``graph`` without and with CUDA graphs on a GPU cost model, from any machine.

    ``graph``: a GraphModule, or a ``Captured`` (its ``phase`` graph; its parameters and
    buffers are found from dynamo's names and read in place). ``cost``: a cost model for a
    GPU DeviceSpec (default ``Analytic(get_device("h100"))``) or a DeviceSpec name.
    ``static_inputs``: placeholder names at fixed addresses (parameters) for a bare graph.
    Returns (before_us, after_us, regions).
    """
    if cost is None or isinstance(cost, str):
        cost = Analytic(get_device(cost or DEFAULT_GPU))
    if cost.device.kind != "cuda":
        raise ValueError(f"predict CUDA graphs for a GPU DeviceSpec, not {cost.device.name!r}")
    if not isinstance(graph, fx.GraphModule):
        captured = graph
        gm = dict(captured.graphs()).get(phase)
        if gm is None:
            raise ValueError(f"the captured graph has no {phase!r} graph (training={captured.training})")
        training = captured.training
        if static_inputs is None and phase == "fw":
            static_inputs = captured_static_inputs(captured)
        graph = gm
    ctx = PassContext(device="cuda", training=training, phase=phase, cost_model=cost)
    work = copy_graph_module(graph)
    _, prediction, _ = plan(work, ctx, cost, min_gain_us, static_inputs or ())
    return prediction


def captured_static_inputs(captured) -> tuple[str, ...]:
    """Forward placeholders that receive the model's parameters or buffers."""
    forward = [n.name for n in captured.forward.graph.nodes if n.op == "placeholder"]
    if len(captured.example_inputs) != len(forward):
        return ()  # aot added or removed inputs: do not guess
    return tuple(f for i, f in enumerate(forward) if i in captured.state_positions)


def annotate_regions(gm: fx.GraphModule, ctx: PassContext, cost=None, min_gain_us: float = 0.0,
                     static_inputs=None) -> fx.GraphModule:
    """A flat copy of ``gm`` whose kept regions carry ``meta[CUDA_GRAPH_REGION]`` (plus the
    output clones), for ``fxdream.predict.graph_prediction`` on a GPU cost model."""
    cost = cost or _gpu_cost(ctx)
    work = copy_graph_module(gm)
    _, _, kept = plan(work, ctx, cost, min_gain_us, static_inputs)
    rewritten = replace_regions(copy_graph_module(work), kept, _static_names(work, ctx, static_inputs), RunnerOptions())
    return inline_cuda_graph_runners(rewritten)


# --- the pass ---------------------------------------------------------------------------------

@register_pass
class CudaGraphs(PassBase):
    """Capture the static regions of each graph in CUDA graphs (see the module docstring).

    ``min_gain_us``: a region must be predicted to save more than this. ``max_shapes``:
    shape keys captured per region before new shapes run eagerly. ``strict``: raise
    instead of falling back (here if any node is left out; at run time if a region would
    run eagerly). ``clone_outputs``: clone outputs that leave the graph (default) or guard
    them (raise when one is still held at the next replay).
    """
    name = "cuda_graphs"
    order = 10  # schedules the final graph's kernels: after the passes that rewrite it

    def __init__(self, min_gain_us: float = 0.0, max_shapes: int = MAX_SHAPES, strict: bool = False,
                 clone_outputs: bool = True):
        self.min_gain_us = min_gain_us
        self.options = RunnerOptions(max_shapes, strict, clone_outputs)

    def requires(self, ctx: PassContext) -> str | None:
        if not ctx.forced and ctx.device != "cuda":  # "auto" on a CPU: nothing it could apply
            return f"{NEEDS_CUDA} (name the pass to get its prediction for a GPU)"
        return None  # named on a CPU, it still marks, partitions and predicts for a GPU

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        cost = _gpu_cost(ctx)
        marked, prediction, kept = plan(gm, ctx, cost, self.min_gain_us, options=self.options)
        if self.options.strict and marked:
            raise CudaGraphFallback(f"strict=True: {len(marked)} node(s) cannot be captured: "
                                    + "; ".join(marked_notes(marked)))
        memory = prediction.memory_bytes
        summary = (f"predicted on {cost.device.name} ({type(cost).__name__.lower()}): "
                   f"{prediction.before_us / 1e3:.3f} ms → {prediction.after_us / 1e3:.3f} ms "
                   f"({prediction.speedup:.2f}x) with {len(kept)} of {len(prediction.regions)} region(s), "
                   f"{memory / 2**20:.1f} MiB held by the graphs")
        left_out = f"; {len(marked)} node(s) left out" if marked else ""
        notes = (summary,) + tuple(r.describe() for r in prediction.regions) + marked_notes(marked)
        if ctx.device != "cuda":
            return PassResult(gm, False, f"{NEEDS_CUDA}; {summary}{left_out}", notes)
        if not kept:
            return PassResult(gm, False, f"no region is predicted to pay off; {summary}{left_out}", notes)
        replace_regions(gm, kept, _static_names(gm, ctx), self.options, ctx.phase)
        if not torch.cuda.is_available():  # a dry plan for a GPU spec (fxdream.simulate, explain): regions
            # marked in a flat graph the simulator lowers, never run here
            return PassResult(inline_cuda_graph_runners(gm), True, f"planned for {cost.device.name}, not run "
                              f"here ({NEEDS_CUDA}): {len(kept)} region(s); {summary}{left_out}", notes)
        kernels = sum(r.kernels for r in prediction.regions if r.kept)
        return PassResult(gm, True, f"captured {len(kept)} region(s), {kernels} kernels, in CUDA graphs; "
                                    f"{summary}{left_out}", notes)
