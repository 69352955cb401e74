"""What identifies one op for costing: its profile key, and the small helpers keys rest on.

Apart from ``cost`` so that the in-context timing (``in_context``) and the cost models can
both use them without importing each other."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fxdream.ir.nodes import arg_values, op_name
from fxdream.ir.tensors import size_hint

# Ops that make the host wait for the device (a value read back, a data-dependent shape).
HOST_SYNC_OPS = frozenset({"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.equal",
                           "aten.is_nonzero", "aten.masked_select", "aten.unique"})


def profile_key(node: fx.Node, device: str) -> str:
    """op + tensor shapes/dtypes/strides + other arguments + device: one measurement each.
    (The string ``tree_flatten`` of ``arg_values`` gives, built without pytree: a build makes
    thousands, and pytree is slow for that.)"""
    parts: list[str] = []
    _describe_into(node.args, parts)
    if node.kwargs:
        kwargs = arg_values(node)[1]
        parts += [f"{k}={_describe(v)}" for k, v in sorted(kwargs.items())]
    return f"{op_name(node)}|{device}|{','.join(parts)}"


def _describe_into(a, parts: list) -> None:
    """Append a description of each leaf of ``a`` (pytree's leaves: lists, tuples and dicts
    flattened, a node stands for its value)."""
    if isinstance(a, fx.Node):
        a = a.meta.get("val")
    if isinstance(a, (list, tuple)):
        for item in a:
            _describe_into(item, parts)
    elif isinstance(a, dict):
        for leaf in tree_flatten(a)[0]:
            _describe_into(leaf, parts)
    else:
        parts.append(_describe(a))


def _describe(a) -> str:
    if isinstance(a, torch.Tensor):
        return f"T{_ints(a.shape)}:{str(a.dtype).replace('torch.', '')}:{_ints(a.stride())}"
    return repr(size_hint(a))


def _ints(values) -> tuple:
    values = tuple(values)
    return values if all(type(v) is int for v in values) else tuple(map(size_hint, values))


