"""Copies in inference graphs that nothing needs, dropped at capture.

aot_autograd's inference graph for BERT (ours and Hugging Face's) holds an ``aten.clone`` at
each eval-mode dropout: a copy of a fresh intermediate that nothing else reads. Eager runs no
such copy; on a GPU each is a device-to-device copy on every call, and on any device a host
dispatch. Such a clone is replaced by its input when:

- the input's memory was made new by an ATen op (its schema returns no alias; an item of a
  multi-output op counts), reached back through views each read by one op only;
- the input (and each view on the way) is read by the clone alone;
- the clone has the input's dtype, shape and strides (a layout-changing clone stays).

The graph is functional at capture, so nothing writes that memory afterwards; values are
bit-identical. Inference only.
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxdream.ir.aliasing import aliased_input
from fxdream.ir.nodes import LAYER, is_view
from fxdream.ir.tensors import same_layout

_CLONE = torch.ops.aten.clone.default


def drop_dead_copies(gm: fx.GraphModule) -> list[str]:
    """Remove the clones described above from ``gm`` (recompiled if any); their layers or names."""
    dropped = []
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not _CLONE or not isinstance(node.args[0], fx.Node):
            continue
        source = node.args[0]
        if _read_only_by(source, node) and same_layout(node.meta.get("val"), source.meta.get("val")):
            node.replace_all_uses_with(source)
            gm.graph.erase_node(node)
            dropped.append(node.meta.get(LAYER) or node.name)
    if dropped:
        gm.recompile()
    return dropped


def _read_only_by(value: fx.Node, clone: fx.Node) -> bool:
    """``value``'s memory is new, made by an ATen op, and ``clone`` is its only reader (through
    views, each read by the next alone)."""
    reader = clone
    while True:
        if list(value.users) != [reader] or value.op != "call_function":
            return False
        if value.target is operator.getitem:  # an item of a multi-output op: its own memory
            parent = value.args[0]
            return isinstance(parent, fx.Node) and _makes_new_memory(parent)
        if not is_view(value):
            return _makes_new_memory(value)
        reader, value = value, value.args[0]
        if not isinstance(value, fx.Node):
            return False


def _makes_new_memory(node: fx.Node) -> bool:
    """An ATen op that writes none of its arguments and returns new memory (reinplace's rule)."""
    return (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
            and not node.target._schema.is_mutable and aliased_input(node) is None)
