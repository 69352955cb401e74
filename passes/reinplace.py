"""reinplace: run an elementwise op in place (``relu`` → ``relu_``, ``add`` → ``add_``) where the
tensor it would overwrite is an intermediate nobody reads afterwards.

aot_autograd hands us functional graphs: every ReLU and residual add writes a new tensor, where
eager PyTorch code (``nn.ReLU(inplace=True)``, ``out += identity``) writes in place. On a CPU
a large new tensor is fresh memory from the OS on every step, and filling it can cost more
than the arithmetic, so without this a captured training step runs slower than eager.

A pointwise ATen op with an in-place twin (same overload name, its first argument written) is
rewritten when the argument it would overwrite (the second one instead for ``add``/``mul``,
which commute)
- lives in memory an ATen op in this graph made as new (followed back through views, aot's
  ``_unsafe_view`` (a view its schema does not declare) and in-place results: never a graph
  input, a parameter or a constant, nor anything a non-ATen call returned);
- is read, through any alias of that memory, by nothing after the op (not the graph's output
  either: a saved-for-backward tensor is one), and before it only by ATen ops that neither
  alias nor write it; the op reads no other alias of it (``add(a, a.t())``);
- has the result's shape, dtype and strides (no broadcast into it, no type promotion);
- and every op touching that memory runs on the op's own CUDA stream (an aux stream may still
  be reading it) and outside a captured CUDA graph region. Its ``order`` puts it after
  ``aux_stream_backward``; named before it, an in-place write that a weight gradient moved to
  the aux stream could race is caught by that pass's stream checker, which then refuses its
  rewrite (reported), so nothing runs unordered.

Values are bit-identical: the same kernel arithmetic writes into another buffer. Under
``passes="auto"`` the pass is ``final``: it runs once on the chosen subset's graph (not in every
subset, which would double them) and is kept only if the graph is then predicted faster.
"""
from __future__ import annotations

from collections import Counter

import torch
import torch.fx as fx

from fxdream.ir.aliasing import UNKNOWN, aliased_input
from fxdream.ir.nodes import is_view, schema_arguments
from fxdream.ir.tensors import same_layout
from fxdream.pass_api import LAYER, Note, PassBase, PassContext, PassResult, register_pass
from fxdream.runtime import streams
from fxdream.sim.graph_regions import CUDA_GRAPH_REGION

aten = torch.ops.aten
COMMUTATIVE = {aten.add.Tensor, aten.mul.Tensor}


def in_place_twin(op) -> torch._ops.OpOverload | None:
    """``aten.relu_.default`` for ``aten.relu.default``: pointwise ops whose in-place overload
    writes its first argument; None for anything else (views, reductions, non-ATen calls)."""
    if not isinstance(op, torch._ops.OpOverload) or torch.Tag.pointwise not in op.tags:
        return None
    packet = getattr(aten, op.overloadpacket.__name__ + "_", None)
    twin = getattr(packet, op._overloadname, None) if packet is not None else None
    if twin is None or not twin._schema.arguments:
        return None
    written = twin._schema.arguments[0].alias_info
    return twin if written is not None and written.is_write else None


def _reads_only(user: fx.Node, value: fx.Node) -> bool:
    """``user`` is an ATen op that reads ``value`` without writing it or returning an alias of it."""
    if user.op != "call_function" or not isinstance(user.target, torch._ops.OpOverload):
        return False
    if is_view(user):
        return False
    for argument, given in schema_arguments(user):
        holds = given is value or (isinstance(given, (list, tuple)) and any(g is value for g in given))
        if holds and argument.alias_info is not None:
            return False
    return True


class _Buffers:
    """Which nodes share memory: each node's base (the node that made the memory, following
    views, ``_unsafe_view`` and in-place results back) and each base's family of aliases."""

    def __init__(self, graph: fx.Graph):
        self.order = {n: i for i, n in enumerate(graph.nodes)}
        self.base: dict[fx.Node, object] = {}
        self.family: dict[object, list[fx.Node]] = {}
        for node in graph.nodes:
            self._add(node, aliased_input(node))

    def _add(self, node: fx.Node, aliased) -> None:
        base = node if aliased is None else UNKNOWN if aliased is UNKNOWN else self.base.get(aliased, UNKNOWN)
        self.base[node] = base
        self.family.setdefault(base, []).append(node)

    def can_overwrite(self, value: fx.Node, op: fx.Node) -> bool:
        """Whether ``op`` may write its result into ``value``'s memory (see the module docstring)."""
        base = self.base.get(value, UNKNOWN)
        if base is UNKNOWN or base.op != "call_function":  # graph inputs, constants, unknown makers
            return False
        if not same_layout(value.meta.get("val"), op.meta.get("val")) or CUDA_GRAPH_REGION in op.meta:
            return False
        family = self.family[base]
        if any(a is not value and a in family for a in op.all_input_nodes):  # e.g. add(a, a.t())
            return False
        stream = streams.node_stream(op)
        for member in family:
            if (self.order[member] > self.order[op] or streams.node_stream(member) != stream
                    or CUDA_GRAPH_REGION in member.meta):
                return False
            for user in member.users:
                if user is op or self.base.get(user) is base:  # op, or a view / in-place link (above)
                    continue
                if (self.order[user] > self.order[op] or not _reads_only(user, member)
                        or streams.node_stream(user) != stream or CUDA_GRAPH_REGION in user.meta):
                    return False
        return True

    def replaced(self, node: fx.Node, result: fx.Node, value: fx.Node) -> None:
        """``result`` (an in-place op writing ``value``) took erased ``node``'s place; the views
        of ``node``'s memory now alias ``value``'s."""
        old_base = self.base.pop(node)
        self.family[old_base].remove(node)
        self.order[result] = self.order.pop(node)
        self._add(result, value)
        if old_base is node:
            new_base = self.base[result]
            for member in self.family.pop(node):
                self.base[member] = new_base
                self.family[new_base].append(member)


def reinplace_graph(gm: fx.GraphModule) -> list[Note]:
    """Rewrite ``gm`` in place; return a note (layer, op) for each op now run in place."""
    buffers = _Buffers(gm.graph)
    changed = []
    for node in list(gm.graph.nodes):
        twin = in_place_twin(node.target) if node.op == "call_function" else None
        if twin is None or not node.args:
            continue
        args = list(node.args)
        options = [0, 1] if node.target in COMMUTATIVE and node.kwargs.get("alpha", 1) == 1 else [0]
        for position in options:
            value = args[position] if position < len(args) else None
            if isinstance(value, fx.Node) and buffers.can_overwrite(value, node):
                if position == 1:
                    args[0], args[1] = args[1], args[0]
                break
        else:
            continue
        with gm.graph.inserting_after(node):
            replacement = gm.graph.call_function(twin, tuple(args), dict(node.kwargs))
        replacement.meta = dict(node.meta)
        node.replace_all_uses_with(replacement)
        gm.graph.erase_node(node)
        buffers.replaced(node, replacement, args[0])
        changed.append(Note(node.meta.get(LAYER) or node.name, twin.overloadpacket.__name__))
    return changed


@register_pass
class Reinplace(PassBase):
    name = "reinplace"
    order = 20   # after the passes that rewrite or schedule the graph: it sees their final ops
    final = True  # under auto: once, on the chosen subset's graph

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        changed = reinplace_graph(gm)
        if not changed:
            return PassResult(gm, False, "no out-of-place elementwise op whose input is a dead intermediate")
        if any(streams.node_stream(n) for n in gm.graph.nodes):  # the stream checker agrees, or no rewrite
            streams.require_stream_order(gm)
        gm.recompile()
        counts = Counter(note.detail for note in changed)
        summary = ", ".join(f"{n} {op}" for op, n in sorted(counts.items()))
        return PassResult(gm, True, f"{len(changed)} op(s) now in place ({summary})", notes=tuple(changed))
