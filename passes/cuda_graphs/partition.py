"""Partition a graph into maximal CUDA-graph regions and replace each by a runner call.

The mechanics of the cuda_graphs pass (passes/cuda_graphs.py), which decides by simulation
which of these regions to keep: greedy extend-or-flush partition in graph order, then the
rewrite of a kept region into a ``CudaGraphRunner`` call plus one ``clone_outputs`` for the
values that leave the graph.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxdream.ir.aliasing import aliases_input
from fxdream.ir.nodes import LAYER, ROOT_LAYER_LABEL, is_view
from fxdream.runtime.cuda_graph_runner import MAX_SHAPES, CudaGraphRunner, clone_outputs

# --- partition ------------------------------------------------------------------------------

def _alias_roots(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Views (chains of them) of a graph input or constant → that placeholder / get_attr."""
    roots: dict[fx.Node, fx.Node] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            roots[node] = node
        elif _is_view_op(node) and node.args and node.args[0] in roots:
            roots[node] = roots[node.args[0]]
    return roots


def partition(gm: fx.GraphModule, marked) -> list[list[fx.Node]]:
    """Maximal runs of capturable call_function nodes in graph order (greedy extend-or-flush).

    Views of graph inputs stay outside every region without ending one: they cost no
    kernel, and evaluated eagerly they alias the caller's tensors exactly as in eager mode
    (inside, they would alias the graph's static copy).
    """
    roots = _alias_roots(gm)
    regions: list[list[fx.Node]] = []
    current: list[fx.Node] = []
    members: set[fx.Node] = set()

    def flush():
        nonlocal current, members
        if current:
            regions.append(current)
        current, members = [], set()

    for node in gm.graph.nodes:
        if node.op in ("placeholder", "get_attr") or (node in roots and node not in marked):
            continue
        capturable = node.op == "call_function" and node not in marked
        if capturable and node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            capturable = node.args[0] in members  # stays with its producer
        if not capturable:
            flush()
            continue
        current.append(node)
        members.add(node)
    flush()
    return regions


def _leaves(user: fx.Node, inside: set) -> bool:
    """Whether a use outside the region hands the value out of the graph (output, or views to it)."""
    if user.op == "output":
        return True
    return user.op == "call_function" and (is_view(user) or aliases_input(user)) and _escapes(user, inside)


def _escapes(node: fx.Node, inside: set) -> bool:
    """Whether ``node``'s value leaves the graph, directly or through views outside the region."""
    return any(user not in inside and _leaves(user, inside) for user in node.users)


def _is_view_op(node: fx.Node) -> bool:
    """A view of one tensor (getitem picks from a tuple: not a view here)."""
    return node.op == "call_function" and node.target is not operator.getitem and is_view(node)


def _view_chain(node: fx.Node, inside: set):
    """(base, [views from the base to ``node``]) for a view inside the region, or None when a
    view in the chain reads another value (it cannot be replayed on a copy of the base)."""
    chain = [node]
    current = node
    while True:
        parent = current.args[0] if current.args else None
        others = [a for a in current.all_input_nodes if a is not parent]
        if not isinstance(parent, fx.Node) or others:
            return None
        if parent not in inside or not _is_view_op(parent):
            return parent, chain
        chain.insert(0, parent)
        current = parent


def layer_of(node: fx.Node) -> str:
    return node.meta.get(LAYER, "") or ROOT_LAYER_LABEL


# --- rewrite --------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunnerOptions:
    max_shapes: int = MAX_SHAPES
    strict: bool = False
    clone_outputs: bool = True


def replace_regions(gm: fx.GraphModule, regions: list[tuple[int, list[str]]], static_names: set[str],
                    options: RunnerOptions, phase: str = "fw") -> fx.GraphModule:
    """Replace each region (id, node names) of ``gm`` (in place) by a runner call; returns ``gm``.

    After the call: one ``clone_outputs`` of the outputs that leave the graph; a view that
    leaves is replayed eagerly on the clone of its base (so it aliases like in eager mode).
    """
    by_name = {n.name: n for n in gm.graph.nodes}
    roots = _alias_roots(gm)
    for region_id, names in regions:
        nodes = [by_name[n] for n in names]
        region = _Region.of(region_id, nodes)
        static = [a.name in static_names or a.op == "get_attr"
                  or (a in roots and (roots[a].name in static_names or roots[a].op == "get_attr"))
                  for a in region.inputs]
        runner = CudaGraphRunner(region.graph_module(), region_id, static, max_shapes=options.max_shapes,
                                 strict=options.strict, guard_outputs=() if options.clone_outputs else region.escaping,
                                 label=f"{phase} cuda graph {region_id} ({layer_of(nodes[0])} … {layer_of(nodes[-1])})")
        target = f"cuda_graph_{region_id}"
        gm.add_submodule(target, runner)
        call, static_out, leaving = _insert_call(gm.graph, target, region, options.clone_outputs)
        _reroute_uses(region, call, static_out, leaving)
        for n in reversed(nodes):
            gm.graph.erase_node(n)
    gm.graph.lint()
    gm.recompile()
    return gm


@dataclass(frozen=True)
class _Region:
    """One region's interface: the nodes it holds, the values it reads from outside, the values
    it hands out, which of those leave the graph (cloned after each replay, by position in
    ``outputs``) and the views that leave, replayed eagerly on their base (view → (base, chain))."""
    region_id: int
    nodes: tuple
    inside: frozenset
    inputs: tuple
    outputs: tuple
    escaping: tuple
    replay: dict

    @classmethod
    def of(cls, region_id: int, nodes: list[fx.Node]) -> "_Region":
        inside = frozenset(nodes)
        inputs = tuple(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))
        replay = {n: found for n in nodes if _is_view_op(n) and _escapes(n, inside)
                  for found in [_view_chain(n, inside)] if found is not None}
        wanted = set()
        for n in nodes:
            outside = [u for u in n.users if u not in inside]
            if n in replay:
                if any(not _leaves(u, inside) for u in outside):
                    wanted.add(n)  # eager users inside the graph read the static buffer
                base = replay[n][0]
                if base in inside:
                    wanted.add(base)
            elif outside:
                wanted.add(n)
        outputs = tuple(n for n in nodes if n in wanted)
        to_clone = {o for o in outputs if o not in replay and _escapes(o, inside)}
        to_clone |= {base for base, _ in replay.values() if base in inside}
        escaping = tuple(i for i, o in enumerate(outputs) if o in to_clone)
        return cls(region_id, tuple(nodes), inside, inputs, outputs, escaping, replay)

    def graph_module(self) -> fx.GraphModule:
        """The region's nodes as a graph of their own, reading ``inputs``, returning ``outputs``."""
        sub = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        for a in self.inputs:
            env[a] = sub.placeholder(a.name)
            env[a].meta = dict(a.meta)
        for n in self.nodes:
            env[n] = sub.node_copy(n, lambda x: env[x])
        sub.output(tuple(env[o] for o in self.outputs))
        return fx.GraphModule(torch.nn.Module(), sub, class_name=f"CudaGraphRegion{self.region_id}")


def _insert_call(graph: fx.Graph, target: str, region: _Region, clone: bool):
    """After the region's last node: the runner call, a getitem per output, the clone of the
    escaping ones (``clone``), the leaving views replayed. Returns (call, output → its static
    getitem, value → what a use that leaves the graph reads)."""
    def after(node, make):
        with graph.inserting_after(node):
            return make()

    nodes, outputs = region.nodes, region.outputs
    call = after(nodes[-1], lambda: graph.call_module(target, tuple(region.inputs)))
    call.meta["val"] = tuple(o.meta.get("val") for o in outputs)
    call.meta[LAYER] = nodes[0].meta.get(LAYER, "")
    last = call
    static_out: dict[fx.Node, fx.Node] = {}
    for i, o in enumerate(outputs):
        last = after(last, lambda i=i: graph.call_function(operator.getitem, (call, i)))
        last.meta = {k: v for k, v in o.meta.items() if k in ("val", "tensor_meta", LAYER)}
        static_out[o] = last
    leaving = dict(static_out)
    if clone and region.escaping:
        cloned = after(last, lambda: graph.call_function(clone_outputs, tuple(static_out[outputs[i]]
                                                                              for i in region.escaping)))
        cloned.meta["val"] = tuple(outputs[i].meta.get("val") for i in region.escaping)
        cloned.meta[LAYER] = call.meta[LAYER]
        last = cloned
        for k, i in enumerate(region.escaping):
            last = after(last, lambda k=k: graph.call_function(operator.getitem, (cloned, k)))
            last.meta = dict(static_out[outputs[i]].meta)
            leaving[outputs[i]] = last
    for view, (base, chain) in region.replay.items():
        current = leaving[base] if base in region.inside else base
        for v in chain:
            parent = v.args[0]
            made = after(last, lambda v=v, parent=parent, current=current:
                         graph.node_copy(v, lambda x: current if x is parent else x))
            made.meta = dict(v.meta)
            last = current = made
        leaving[view] = current
    return call, static_out, leaving


def _reroute_uses(region: _Region, call: fx.Node, static_out: dict, leaving: dict) -> None:
    """Point every use outside the region at what replaces its value: the clone (or replayed
    view) where the use hands it out of the graph, the static output otherwise."""
    inserted = set(static_out.values()) | set(leaving.values())
    for n in region.nodes:
        for user in list(n.users):
            if user in region.inside or user is call or user in inserted:
                continue
            replacement = leaving[n] if _leaves(user, region.inside) and n in leaving else static_out.get(n)
            if replacement is None:
                raise AssertionError(f"region {region.region_id}: {n.name} is used by {user.name} but not an output")
            user.replace_input_with(n, replacement)
