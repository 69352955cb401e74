"""Which memory a node's value shares: views, in-place writes, graph inputs."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fxdream.ir.nodes import is_view, schema_arguments

UNKNOWN = object()  # a value made by something other than an ATen op: who knows what it aliases


def aliased_input(node: fx.Node):
    """The node whose memory ``node``'s value shares (a view's or an in-place op's input), None
    for new memory, UNKNOWN for a value not made by an ATen op (a graph input is its own base)."""
    if node.op == "placeholder":
        return None
    if node.op != "call_function":
        return UNKNOWN
    if node.target is operator.getitem:  # an item of a split aliases what the split aliases
        parent = node.args[0]
        return parent if isinstance(parent, fx.Node) and aliased_input(parent) is not None else None
    if not isinstance(node.target, torch._ops.OpOverload):
        return UNKNOWN
    if is_view(node):  # the project's view list, with aot's _unsafe_view (its schema claims new memory)
        return node.args[0]
    returns = node.target._schema.returns
    sets = {name for r in returns if r.alias_info is not None for name in r.alias_info.before_set}
    if not sets:
        return None
    for argument, given in schema_arguments(node):
        if argument.alias_info is not None and sets & set(argument.alias_info.before_set):
            return given if isinstance(given, fx.Node) else UNKNOWN
    return UNKNOWN


def written_inputs(gm: fx.GraphModule) -> frozenset[int] | None:
    """Positions of the placeholders whose memory ``gm`` writes (an in-place op or an ``out=``
    on one, or on a view of one), or None where that cannot be told (a call of something that
    is not an ATen op: a submodule, a Python function, an unknown alias)."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    written = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.op != "call_function" or not (node.target is operator.getitem
                                               or isinstance(node.target, torch._ops.OpOverload)):
            return None
        for argument, given in schema_arguments(node):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            for value in tree_flatten(given)[0]:
                while isinstance(value, fx.Node) and value not in placeholders:
                    base = aliased_input(value)
                    if base is UNKNOWN:
                        return None
                    value = base
                if value in placeholders:
                    written.add(placeholders[value])
    return frozenset(written)


def aliases_input(node: fx.Node) -> bool:
    """In-place and out= ops return an input: no new memory."""
    schema = getattr(node.target, "_schema", None)
    return bool(schema and any(r.alias_info is not None for r in schema.returns))
