"""Graph code that calls each op's dispatcher entry directly: one Python frame less per op.

FX writes ``torch.ops.aten.addmm.default(x, w, b)``, and ``OpOverload.__call__`` is one line
of Python forwarding to ``OpOverload._op``, the C++ entry of the dispatcher: calling ``_op``
is the same call without that frame. On small models a graph's Python cost decides whether it
beats eager, and that frame is a share of it; on large ones it is lost in the kernels' time.

Registered as the graph's code transformer (``fx.Graph.on_generate_code``), it goes with every
copy of the graph (candidates, timed copies), so what is timed is what runs. ``gm.code`` shows
the calls as run: ``torch.ops.aten.addmm.default._op(x, w, b)``.
"""
from __future__ import annotations

import re
from typing import Callable

import torch
import torch.fx as fx

_QUALIFIED_CALL = re.compile(r"\b(torch\.ops\.\w+\.\w+\.\w+)\(")
_DIRECT: dict[str, bool] = {}  # qualified name → whether it names a plain OpOverload


def call_ops_directly(gm: fx.GraphModule, recompile: bool = True) -> fx.GraphModule:
    """``gm``, its code generated from now on calling plain ``OpOverload``s through ``_op``
    (at once with ``recompile``, which costs one more code generation; without it, its copies
    get the direct calls, ``gm`` keeps its code until recompiled). A graph that
    already has a code transformer (its author's) is left as it is."""
    current = getattr(gm.graph._codegen, "_body_transformer", None)
    if current is None:
        gm.graph.on_generate_code(lambda _: direct_calls)
    if recompile and current in (None, direct_calls):
        gm.recompile()
    return gm


def direct_calls(body: list[str]) -> list[str]:
    """The generated lines, each ``torch.ops.NS.OP.OVERLOAD(`` of a plain OpOverload calling its ``_op``."""
    return [_QUALIFIED_CALL.sub(_direct_call, line) if "torch.ops." in line else line for line in body]


def direct(target: Callable) -> Callable:
    """The callable that runs ``target`` without ``OpOverload.__call__``'s frame (itself otherwise)."""
    return target._op if type(target) is torch._ops.OpOverload else target


def _direct_call(match: re.Match) -> str:
    name = match.group(1)
    if name not in _DIRECT:
        _DIRECT[name] = type(_resolve(name)) is torch._ops.OpOverload  # not TorchBind's, which override __call__
    return f"{name}._op(" if _DIRECT[name] else match.group(0)


def _resolve(qualified_name: str):
    value = torch.ops
    try:
        for part in qualified_name.split(".")[2:]:
            value = getattr(value, part)
    except (AttributeError, RuntimeError):
        return None
    return value
