"""Lower captured FX graphs to a Daydream task graph.

Per compute node: one host task (dispatch, plus the launch on a GPU) on ``cpu:0`` and,
on a GPU, one kernel on the node's stream (``node.meta["stream"]``, default 0) with a
LAUNCH edge. On a CPU device the kernel runs on the launching thread, so host and kernel
are one task. Views cost only dispatch. Data dependencies across streams become EVENT
edges; ops that read a device value on the host (``.item()``, nonzero) add a SYNC task.
Memory: a kernel allocates its outputs when it starts; a buffer is freed when the last
task using it (through any view) ends, unless it leaves the iteration (an output, a
gradient, what a forward returns to its caller). A kernel also holds its workspace from start
to end (``fxdream.sim.workspaces``, and a cost model's ``workspace_bytes``: split-K's).
Training adds the optimizer step as its own tasks, and, where no measured host
gaps hold them, autograd's engine: a host task running each backward graph's node and one
handing its parameters their gradients (AccumulateGrad).

CUDA graphs: nodes with ``meta[CUDA_GRAPH_REGION]`` (or a runner module the cuda_graphs
pass put in the graph, inlined first) form a captured region. On a GPU a region lowers to
one host task that launches the whole graph (``DepKind.GRAPH_LAUNCH`` edges to each of
its kernels), preceded by one copy of the inputs that are not at fixed addresses into the
graph's static buffers, and its kernels on the stream: no per-kernel dispatch or launch,
and views cost nothing. The graph's private memory pool (static inputs plus the peak of
its own buffers) is held for good, so it counts as static memory. On a CPU device regions
are ignored (there are no CUDA graphs).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fxdream.capturing.captured import captured_parts
from fxdream.capturing.host_gaps import END, StepCalls
from fxdream.capturing.layers import renamed_layer
from fxdream.ir.nodes import LAYER, PARAMETER_GRADIENTS, is_view, op_name
from fxdream.ir.tensors import size_hint, tensor_bytes
from fxdream.sim.call_order import EAGER, append_host_gap, as_called
from fxdream.sim.cost.model import CostModel
from fxdream.sim.graph_regions import CUDA_GRAPH_REGION, GraphRegion, cuda_graph_regions, inline_cuda_graph_runners
from fxdream.sim.liveness import Buffers
from fxdream.sim.optimizer_step import OptimizerModel, append_optimizer_step
from fxdream.sim.profile.op_keys import HOST_SYNC_OPS
from fxdream.sim.taskgraph import DepKind, Task, TaskGraph, TaskKind
from fxdream.sim.workspaces import workspace_bytes

STREAM = "stream"  # node.meta key: the GPU stream a node's kernel runs on
# Host cost of one graph launch beyond the CUDA launch itself: the runner's Python (shape key,
# pointer check, replay call) as framework dispatches, and the driver's per-node work.
# Estimates; the GPU benchmark measures the runner's overhead on a tiny graph.
GRAPH_RUNNER_DISPATCHES = 3
GRAPH_LAUNCH_PER_KERNEL_US = 0.01


@dataclass(frozen=True)
class Lowered:
    graph: TaskGraph
    static_bytes: int  # parameters and inputs alive before the iteration starts


def lower(graphs: Sequence[tuple[str, fx.GraphModule]], cost: CostModel,
          optimizer: OptimizerModel | None = None, host_gaps: Mapping[str, float] | None = None,
          layer_renames: Mapping[str, tuple[str, str]] | None = None,
          gap_layers: Mapping[str, tuple] | None = None) -> Lowered:
    """``graphs`` are (label, GraphModule) in execution order, e.g. [("g0.fw", fw), ("g0.bw", bw)].

    ``host_gaps``: µs of host work outside the graphs, measured (``fxdream.capturing.host_gaps``), by
    the label of the graph it precedes or ``END``: one host task each, before that graph's call.
    ``layer_renames``: by a call's scope ("g0#2"), the block its graph's layers are named for and
    the block that call ran on (``StepCalls.call_layers``): its tasks are that block's layers.
    ``gap_layers``: by the same labels as ``host_gaps``, the modules that ran in the gap and their
    µs of it (``StepCalls.gap_layers``): a host task each, with its layer."""
    gaps, modules = dict(host_gaps or {}), dict(gap_layers or {})
    lowering = _Lowering(cost)
    saved = {label.rsplit(".", 1)[0]: saved_inputs(gm) for label, gm in graphs if label.endswith(".bw")}
    for graph_index, (label, gm) in enumerate(graphs):
        # measured gaps hold the engine's time; eager ops ran inside the engine's nodes already costed
        engine = host_gaps is None and label.endswith(".bw") and not label.startswith(EAGER)
        if engine:
            _append_autograd(lowering.tg, f"{label}:autograd", cost.device.autograd_node_us)
        lowering.graph(graph_index, label, gm, gaps.pop(label, 0.0), saved.get(label.rsplit(".", 1)[0]),
                       (layer_renames or {}).get(label.rsplit(".", 1)[0]), modules.get(label, ()))
        if engine:
            _append_autograd(lowering.tg, f"{label}:accumulate_grad",
                             len(gradient_outputs(gm)) * cost.device.accumulate_grad_us)
    tg, static = lowering.tg, lowering.static
    append_host_gap(tg, END, gaps.pop(END, 0.0), graphs[-1][0].rsplit(".", 1)[-1] if graphs else "fw",
                    modules.get(END, ()))
    if optimizer is not None and graphs and graphs[-1][0].endswith("bw"):
        # backwards run in reverse subgraph order; the optimizer's gradients are in subgraph order
        backwards = [gm for label, gm in reversed(graphs) if label.endswith("bw")]
        _lower_optimizer(tg, backwards, cost, optimizer, lowering.on_gpu)
        static += optimizer.state_copies * sum(tensor_bytes(g) for bw in backwards for g in gradient_values(bw))
    frees = lowering.buffers.frees()
    for task, workspace in lowering.workspaces.items():
        frees[task] = frees.get(task, 0) + workspace
    return Lowered(_with_memory(tg, lowering.allocs, frees), static)


class _Lowering:
    """One lowering's state: the task graph so far, the buffers, the kernel task that made each
    value (GPU: consumers on other streams wait for it), the bytes each task allocates, and the
    static bytes (inputs, a pass's constants, CUDA-graph pools) alive before the iteration."""

    def __init__(self, cost: CostModel):
        self.cost, self.on_gpu = cost, cost.device.kind != "cpu"
        self.tg, self.buffers = TaskGraph(), Buffers()
        self.kernel_of: dict[str, str] = {}
        self.allocs: dict[str, int] = {}
        self.workspaces: dict[str, int] = {}  # task → bytes it holds while it runs (freed at its end)
        self.static = 0

    def graph(self, graph_index: int, label: str, gm: fx.GraphModule, gap_us: float,
              saved: int | None = None, rename: tuple[str, str] | None = None, gap_modules: tuple = ()) -> None:
        """Append one graph's tasks: the host gap before it, its call, then node by node.
        ``saved``: of a forward's outputs, how many its backward reads (the last ones, as
        aot_autograd orders them); those before go to the caller (``Buffers.output``).
        ``rename``: (the block the graph's layers name, the block this call ran on).
        ``gap_modules``: (layer, µs) of the modules that ran in the gap (``append_host_gap``)."""
        gm = inline_cuda_graph_runners(gm)
        regions = cuda_graph_regions(gm) if self.on_gpu else {}
        self.static += sum(r.pool_bytes for r in regions.values())
        launched: dict[object, str] = {}  # region id → its graph-launch task
        current = None                    # the region being lowered (regions are contiguous)
        self.buffers.scope, phase = label.rsplit(".", 1) if "." in label else (label, label)
        append_host_gap(self.tg, label, gap_us, phase, gap_modules)
        eager = label.startswith(EAGER)  # ops run one by one: no graph call, inputs made by the step
        call_us = self.cost.graph_call_us() if hasattr(self.cost, "graph_call_us") and not eager else 0.0
        if call_us:
            self.tg.append(Task(f"{label}:call", TaskKind.CPU, call_us, "cpu:0", op="graph_call", phase=phase))
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                if phase == "fw" and not eager:
                    self.static += tensor_bytes(node.meta.get("val"))
                self.buffers.define(node)
                continue
            if node.op == "output":
                self.buffers.output(node, graph_index, saved if phase == "fw" else None)
                continue
            if node.op == "get_attr":  # a constant (packed or folded weights, values made from no input):
                self.static += tensor_bytes(node.meta.get("val"))  # alive beside the model's own
            if node.op != "call_function":
                continue
            name = f"{label}:{node.name}"
            layer = node.meta.get(LAYER, "")
            common = dict(layer=renamed_layer(layer, *rename) if rename else layer, op=op_name(node),
                          fx_node=node.name, phase=phase)
            region = node.meta.get(CUDA_GRAPH_REGION) if regions else None
            if region is None and current is not None and not is_view(node):
                current = None  # a kernel outside the region ends it (a view does not)
            if region is None:
                self._node(node, name, common, graph_index)
                continue
            if region not in launched:
                launched[region] = _lower_graph_launch(self.tg, label, phase, regions[region], self.cost,
                                                       self.kernel_of, self.buffers)
            elif region != current:
                raise ValueError(f"{label}: CUDA-graph region {region!r} is not contiguous in graph order "
                                 f"(node {node.name} comes after kernels outside it)")
            current = region
            work = _lower_region_node(self.tg, node, name, common, launched[region], self.cost, self.kernel_of,
                                      self.buffers)
            created = self.buffers.define(node)
            self.buffers.pooled.update(created)  # lives in the graph's pool, counted in static
            self.buffers.use(node, work, graph_index)

    def _node(self, node: fx.Node, name: str, common: dict, graph_index: int) -> None:
        """One op outside a CUDA-graph region: on a CPU one task (dispatch + kernel); on a GPU a
        dispatch task launching a kernel on the node's stream, waiting for inputs made on other
        streams, and a sync after an op that makes the host wait."""
        tg, cost, buffers = self.tg, self.cost, self.buffers
        dispatch, kernel = cost.dispatch_us(node), cost.kernel_us(node)
        if not self.on_gpu:
            tg.append(Task(name, TaskKind.CPU, dispatch + kernel, "cpu:0", **common))
            work = name
        else:
            tg.append(Task(name, TaskKind.CPU, dispatch, "cpu:0", **common))
            work = name
            if not is_view(node):
                stream = int(node.meta.get(STREAM, 0))
                work = tg.append(Task(f"{name}:k", TaskKind.GPU, kernel, f"stream:{stream}",
                                      utilization=cost.utilization(node), **common),
                                 deps=[(name, DepKind.LAUNCH)])
                _wait_for_inputs(tg, node, work, self.kernel_of, buffers)
                if op_name(node) in HOST_SYNC_OPS:
                    tg.append(Task(f"{name}:sync", TaskKind.SYNC, 0.0, "cpu:0", **common),
                              deps=[(work, DepKind.SYNC)])
        if work != name:  # a kernel: consumers on other streams wait for it
            self.kernel_of[buffers.key(node)] = work
        elif node.all_input_nodes:  # a view: its producer is its base's
            self.kernel_of[buffers.key(node)] = self.kernel_of.get(buffers.key(node.all_input_nodes[0]))
        created = buffers.define(node)
        workspace = workspace_bytes(node, cost.device.kind) + (
            cost.workspace_bytes(node) if hasattr(cost, "workspace_bytes") else 0)
        self.allocs[work] = self.allocs.get(work, 0) + sum(buffers.size[b] for b in created) + workspace
        if workspace:
            self.workspaces[work] = self.workspaces.get(work, 0) + workspace
        # a view (a getitem of a multi-output op too) uses its input where the kernel that made it
        # ran: on the host's clock a view can run before that kernel, and an output nothing reads
        # (max_pool2d's indices) would be freed before it is allocated, held from then on
        made_by = self.kernel_of.get(buffers.key(node)) if work == name else None
        buffers.use(node, made_by or work, graph_index)


def _append_autograd(tg: TaskGraph, name: str, us: float) -> None:
    """Autograd's engine around a backward graph: running its node, or handing each parameter
    its gradient (AccumulateGrad), host time (``DeviceSpec.autograd_node_us`` /
    ``accumulate_grad_us``)."""
    if us > 0:
        tg.append(Task(name, TaskKind.CPU, float(us), "cpu:0", op=f"autograd.{name.rsplit(':', 1)[1]}", phase="bw"))


def _wait_for_inputs(tg: TaskGraph, node: fx.Node, work: str, kernel_of: dict, buffers: Buffers) -> None:
    """Inputs produced by kernels on other streams: an event record → wait."""
    stream = tg.task(work).resource
    for arg in node.all_input_nodes:
        producer = kernel_of.get(buffers.key(arg))
        if producer and tg.task(producer).resource != stream:
            tg.add_dep(producer, work, DepKind.EVENT)


def graph_launch_us(cost: CostModel, kernels: int) -> float:
    """Host time to replay one captured graph: the cost model's if it has one, else an estimate."""
    measured = getattr(cost, "graph_launch_us", None)
    if callable(measured):
        return float(measured(kernels))
    device = cost.device
    return (device.launch_overhead_us + GRAPH_RUNNER_DISPATCHES * device.dispatch_overhead_us
            + GRAPH_LAUNCH_PER_KERNEL_US * kernels)


def _lower_graph_launch(tg: TaskGraph, label: str, phase: str, region: GraphRegion, cost: CostModel,
                        kernel_of: dict, buffers: Buffers) -> str:
    """The copy of the inputs into the static buffers (one batched copy), then the graph launch."""
    device = cost.device
    name = f"{label}:cuda_graph{region.region}"
    common = dict(layer="", phase=phase)
    if region.copied_inputs:
        copy_name = f"{name}:copy_in"
        tg.append(Task(copy_name, TaskKind.CPU, device.dispatch_overhead_us + device.launch_overhead_us, "cpu:0",
                       op="cuda_graph.copy_inputs", **common))
        copy_kernel = tg.append(Task(f"{copy_name}:k", TaskKind.GPU, device.kernel_time_us(0, 2 * region.copied_bytes),
                                     "stream:0", op="cuda_graph.copy_inputs", **common),
                                deps=[(copy_name, DepKind.LAUNCH)])
        for arg in region.copied_inputs:
            producer = kernel_of.get(buffers.key(arg))
            if producer and tg.task(producer).resource != "stream:0":
                tg.add_dep(producer, copy_kernel, DepKind.EVENT)
    tg.append(Task(name, TaskKind.CPU, graph_launch_us(cost, region.kernels), "cpu:0", op="cuda_graph.launch",
                   **common))
    return name


def _lower_region_node(tg: TaskGraph, node: fx.Node, name: str, common: dict, launch: str, cost: CostModel,
                       kernel_of: dict, buffers: Buffers) -> str:
    """A node inside a captured graph: its kernel only, launched by the graph; a view costs nothing."""
    if is_view(node):
        if node.all_input_nodes:
            kernel_of[buffers.key(node)] = kernel_of.get(buffers.key(node.all_input_nodes[0]))
        return launch
    stream = int(node.meta.get(STREAM, 0))
    in_graph = getattr(cost, "graph_kernel_us", None)  # a measured cost model knows a replay's kernels
    work = tg.append(Task(f"{name}:k", TaskKind.GPU, in_graph(node) if callable(in_graph) else cost.kernel_us(node),
                          f"stream:{stream}", utilization=cost.utilization(node), **common),
                     deps=[(launch, DepKind.GRAPH_LAUNCH)])
    _wait_for_inputs(tg, node, work, kernel_of, buffers)
    kernel_of[buffers.key(node)] = work
    return work


def _with_memory(tg: TaskGraph, allocs: dict[str, int], frees: dict[str, int]) -> TaskGraph:
    changed = TaskGraph()
    for task in tg.tasks:
        a, f = allocs.get(task.name, 0), frees.get(task.name, 0)
        changed.add_task(task.replace(mem_alloc=a, mem_free=f) if (a or f) else task)
    for dep in tg.deps:
        changed.add_dep(dep.src, dep.dst, dep.kind)
    return changed


def saved_inputs(bw: fx.GraphModule) -> int:
    """How many of a backward graph's inputs its forward saved: all but the incoming gradients
    (aot_autograd's ``tangents_*``)."""
    return sum(1 for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents"))


def gradient_values(bw: fx.GraphModule) -> list[torch.Tensor]:
    """The parameter gradients a backward graph returns, in order (what the optimizer updates)."""
    return [node.meta["val"] for _, node in gradient_outputs(bw)]


def gradient_outputs(bw: fx.GraphModule) -> list[tuple[int, fx.Node]]:
    """(output position, node) of each parameter gradient a backward graph returns."""
    output = next(n for n in bw.graph.nodes if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (tuple, list)) else tree_flatten(output.args)[0]
    parameters = output.meta.get(PARAMETER_GRADIENTS)  # None: not captured by fxdream, all count
    found = []
    for position, arg in enumerate(values):
        grad = arg.meta.get("val") if isinstance(arg, fx.Node) else None
        if isinstance(grad, torch.Tensor) and grad.is_floating_point() and (parameters is None or position in parameters):
            found.append((position, arg))
    return found


def _lower_optimizer(tg: TaskGraph, backwards: list[fx.GraphModule], cost: CostModel, optimizer: OptimizerModel,
                     on_gpu: bool) -> None:
    """The update of every gradient the backward graphs return (every subgraph's) and of those
    eager code made (``OptimizerModel.outside_gradients``), after the last backward."""
    grads = [g for bw in backwards for g in gradient_values(bw)]
    append_optimizer_step(tg, [(tensor_bytes(g), size_hint(g.numel())) for g in grads] + list(
        optimizer.outside_gradients), cost.device, optimizer, on_gpu)


def lower_captured(captured, cost: CostModel, optimizer: OptimizerModel | None = None,
                   graphs: dict | None = None, step: StepCalls | None = None) -> Lowered:
    """Lower a Captured (or a tuple of them), optionally with rewritten graphs by (index, phase).

    Without ``step``: every forward in subgraph order, then every backward in reverse. With a
    ``step`` (``fxdream.host_gaps``): the graphs in the order that step called them, each call
    once (a repeated call is labelled "g0#1.fw"; the j-th backward call of a subgraph pairs
    with its forwards last-in first-out, for liveness), and, where it was measured, its host
    gaps between (which hold autograd's engine; without them the engine is modelled)."""
    items = captured_parts(captured)
    pairs = []
    for c in items:
        for phase, gm in c.graphs():
            pairs.append((f"g{c.index}.{phase}", (graphs or {}).get((c.index, phase), gm)))
    if step is None:
        # all forwards run before all backwards (backward visits subgraphs in reverse)
        ordered = [p for p in pairs if p[0].endswith("fw")] + [p for p in reversed(pairs) if p[0].endswith("bw")]
        return lower(ordered, cost, optimizer)
    ordered, gaps, renames, gap_layers = as_called(dict(pairs), step)
    return lower(ordered, cost, optimizer, gaps if step.measured else None, renames, gap_layers)
