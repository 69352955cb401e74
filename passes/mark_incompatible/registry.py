"""The per-op registry of CUDA-graph compatibility that ``mark_incompatible`` consults first.

As MXNet's ``FIsCUDAGraphsCompatible`` (apache/mxnet #19142): users declare an op incompatible,
with a reason (a string, or a function deciding per node), or compatible, overriding the
built-in rules. ``fxdream.cuda_graph_incompatible`` and ``cuda_graph_compatible`` are these.
"""
from __future__ import annotations

from typing import Callable, Union

import torch
import torch.fx as fx

from fxdream.pass_api import PassContext

Reason = Union[str, Callable[[fx.Node, PassContext], "str | None"]]
_REGISTRY: dict[object, Reason | None] = {}  # op → reason (None: declared compatible)
_COMPATIBLE = object()


def _resolve_op(op):
    """An OpOverload / OpOverloadPacket / callable, or a name such as "aten.nonzero(.default)"."""
    if not isinstance(op, str):
        if not callable(op):
            raise TypeError(f"op must be an operator, a callable or a name like 'aten.nonzero', got {op!r}")
        return op
    parts = op.split(".")
    if len(parts) not in (2, 3):
        raise ValueError(f"op name {op!r} must look like 'aten.nonzero' or 'aten.nonzero.default'")
    try:
        resolved = getattr(getattr(torch.ops, parts[0]), parts[1])
        return getattr(resolved, parts[2]) if len(parts) == 3 else resolved
    except (AttributeError, RuntimeError) as error:
        raise ValueError(f"no operator {op!r} in torch.ops: {error}") from None


def cuda_graph_incompatible(op, reason: Reason):
    """Declare ``op`` incompatible with CUDA graphs, with a human-readable ``reason``.

    ``op``: an ATen op (overload or packet, e.g. ``torch.ops.aten.nonzero``), any callable
    an FX node may target, or its name ("aten.nonzero"). ``reason``: a string, or a
    function ``(node, ctx) -> str | None`` deciding per node (None: compatible), as
    MXNet's dropout is incompatible in training only. A registered op's entry comes
    before the built-in op rules. Returns ``op``, so it also works as a decorator.
    """
    if not (isinstance(reason, str) and reason.strip()) and not callable(reason):
        raise TypeError(f"reason must be a non-empty string or a function (node, ctx) -> str | None, got {reason!r}")
    _REGISTRY[_resolve_op(op)] = reason
    return op


def cuda_graph_compatible(op):
    """Declare ``op`` compatible: it overrides the built-in op rules (tags, RNG, host sync)
    and any earlier registration. Checks on the values (CPU, sparse, symbolic sizes,
    input mutation) still apply."""
    _REGISTRY[_resolve_op(op)] = None
    return op


def forget_cuda_graph_op(op) -> None:
    """Remove a registration (built-in rules apply again)."""
    _REGISTRY.pop(_resolve_op(op), None)


def _registered(node: fx.Node, ctx: PassContext):
    for key in (node.target, getattr(node.target, "overloadpacket", None)):
        if key is not None and key in _REGISTRY:
            reason = _REGISTRY[key]
            if reason is None:
                return _COMPATIBLE
            return reason(node, ctx) if callable(reason) else reason
    return None
