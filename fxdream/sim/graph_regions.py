"""CUDA-graph regions of a flat FX graph: which nodes a captured graph holds, what it copies in
and the memory its private pool keeps.

Nodes with ``meta[CUDA_GRAPH_REGION]`` form a region; a runner module the cuda_graphs pass
put in the graph is inlined first (``inline_cuda_graph_runners``) so that the simulator and
the pass see the same flat graph.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxdream.ir.aliasing import aliases_input
from fxdream.ir.nodes import is_view
from fxdream.ir.tensors import tensor_bytes

CUDA_GRAPH_REGION = "fxdream.cuda_graph_region"  # node.meta key: id of a captured region
CUDA_GRAPH_STATIC = "fxdream.cuda_graph_static"  # node.meta key: value at a fixed address
# (a parameter, buffer or constant): a graph reads it in place instead of copying it in


@dataclass(frozen=True)
class GraphRegion:
    """One captured region of a flat graph: its nodes and what the captured graph holds."""
    region: object
    nodes: tuple[fx.Node, ...]
    inputs: tuple[fx.Node, ...]          # values from outside the region it reads
    outputs: tuple[fx.Node, ...]         # its values read outside it
    copied_inputs: tuple[fx.Node, ...]   # inputs copied into static buffers on every replay
    kernels: int                         # compute nodes (views launch nothing)
    pool_bytes: int                      # static input buffers + the peak of its own buffers

    @property
    def copied_bytes(self) -> int:
        return sum(tensor_bytes(n.meta.get("val")) for n in self.copied_inputs)


def _is_static_input(node: fx.Node) -> bool:
    return node.op == "get_attr" or bool(node.meta.get(CUDA_GRAPH_STATIC))


def cuda_graph_regions(gm: fx.GraphModule) -> dict[object, GraphRegion]:
    """The regions marked by ``meta[CUDA_GRAPH_REGION]`` in a flat graph, in graph order."""
    members: dict[object, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        region = node.meta.get(CUDA_GRAPH_REGION)
        if region is not None and node.op == "call_function":
            members.setdefault(region, []).append(node)
    return {region: _region(region, nodes) for region, nodes in members.items()}


def _region(region, nodes: list[fx.Node]) -> GraphRegion:
    inside = set(nodes)
    inputs = list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
    outputs = [n for n in nodes if any(u not in inside for u in n.users)]
    copied = [a for a in inputs if not _is_static_input(a) and isinstance(a.meta.get("val"), torch.Tensor)]
    return GraphRegion(region, tuple(nodes), tuple(inputs), tuple(outputs), tuple(copied),
                       sum(not is_view(n) for n in nodes),
                       sum(tensor_bytes(a.meta.get("val")) for a in copied) + _peak_bytes(nodes, inside, outputs))


def _peak_bytes(nodes: list[fx.Node], inside: set, outputs: list[fx.Node]) -> int:
    """Peak of the region's own buffers, run in order: outputs are held, others freed after last use."""
    base: dict[fx.Node, fx.Node | None] = {}
    for n in nodes:
        if is_view(n) or aliases_input(n):
            first = n.all_input_nodes[0] if n.all_input_nodes else None
            base[n] = base.get(first) if first in inside else None
        else:
            base[n] = n
    position = {n: i for i, n in enumerate(nodes)}
    last: dict[fx.Node, int] = {}
    held: set = set()
    for n in nodes:
        for a in n.all_input_nodes:
            if a in inside and base.get(a) is not None:
                last[base[a]] = max(last.get(base[a], 0), position[n])
    for n in outputs:
        if base.get(n) is not None:
            held.add(base[n])
    live = peak = 0
    frees: dict[int, int] = {}
    for i, n in enumerate(nodes):
        if base[n] is n:
            size = tensor_bytes(n.meta.get("val"))
            live += size
            peak = max(peak, live)
            if n not in held:
                end = last.get(n, i)
                frees[end] = frees.get(end, 0) + size
        live -= frees.pop(i, 0)
    return peak


def inline_cuda_graph_runners(gm: fx.GraphModule) -> fx.GraphModule:
    """A flat copy of ``gm`` where each CUDA-graph runner call is replaced by its region's nodes.

    A runner is a submodule with ``region_graph`` (the region's GraphModule), ``region_id``
    and ``static_inputs`` (per input: read in place, not copied); the inlined nodes carry
    ``meta[CUDA_GRAPH_REGION] = region_id`` and static inputs ``meta[CUDA_GRAPH_STATIC]``. ``gm`` itself is returned
    when it calls no runner.
    """
    def runner_of(node):
        if node.op != "call_module":
            return None
        sub = gm.get_submodule(node.target)
        return sub if isinstance(getattr(sub, "region_graph", None), fx.GraphModule) else None

    if not any(runner_of(n) is not None for n in gm.graph.nodes):
        return gm
    graph = fx.Graph()
    env: dict[fx.Node, object] = {}
    for node in gm.graph.nodes:
        runner = runner_of(node)
        if runner is not None:
            inner: dict[fx.Node, object] = {}
            placeholders = [n for n in runner.region_graph.graph.nodes if n.op == "placeholder"]
            statics = tuple(getattr(runner, "static_inputs", ())) + (False,) * len(placeholders)
            for ph, arg, static in zip(placeholders, node.args, statics):
                inner[ph] = env[arg] if isinstance(arg, fx.Node) else arg
                if static and isinstance(arg, fx.Node):
                    inner[ph].meta[CUDA_GRAPH_STATIC] = True  # on our copy of the input node
            for rn in runner.region_graph.graph.nodes:
                if rn.op == "placeholder":
                    continue
                if rn.op == "output":
                    env[node] = fx.node.map_arg(rn.args[0], lambda n: inner[n])
                    continue
                copied = graph.node_copy(rn, lambda n: inner[n])
                copied.meta[CUDA_GRAPH_REGION] = runner.region_id
                inner[rn] = copied
        elif (node.op == "call_function" and node.target is operator.getitem
              and isinstance(node.args[0], fx.Node) and runner_of(node.args[0]) is not None):
            env[node] = env[node.args[0]][node.args[1]]
        else:
            env[node] = graph.node_copy(node, lambda n: env[n])
    return fx.GraphModule(gm, graph)
