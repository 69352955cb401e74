"""A graph run in aot_autograd's boxed calling convention that empties the argument list.

aot_autograd hands a compiled backward one list holding the forward's saved activations and
the incoming gradients, and gives up its own references to them (``steal_args``). Code that
unpacks that list into a call (``make_boxed_func``: ``f(*args)``) keeps every one of them alive
until the backward returns, so a training step's peak holds all saved activations beside all
gradients. A graph whose code takes the list and clears it (``torch.fx``'s ``_BoxedCodeGen``)
frees each activation at its last use, as the graph's own ``x = None`` lines intend.
"""
from __future__ import annotations

from typing import Callable

import torch.fx as fx
from functorch.compile import make_boxed_func

_BoxedCodeGen = getattr(fx.graph, "_BoxedCodeGen", None)


def boxed_runner(runnable) -> Callable:
    """``runnable``'s forward taking one list (``_boxed_call``) and emptying it once unpacked:
    for a ``GraphModule`` with torch.fx's plain code generation, a copy of its graph generated
    that way (``runnable`` itself is left as it is: passes and timed copies call it with
    positional arguments); anything else unpacked with ``make_boxed_func``."""
    codegen = getattr(getattr(runnable, "graph", None), "_codegen", None)
    if _BoxedCodeGen is None or not isinstance(runnable, fx.GraphModule) or type(codegen) is not fx.graph.CodeGen:
        return make_boxed_func(runnable.forward)
    graph = fx.Graph()
    graph.output(graph.graph_copy(runnable.graph, {}))
    boxed = _BoxedCodeGen()
    boxed._body_transformer = codegen._body_transformer  # e.g. direct op calls (``direct_calls``)
    graph.set_codegen(boxed)
    run = fx.GraphModule(runnable, graph).forward  # shares runnable's parameters and constants
    run.__func__._boxed_call = True
    return run
