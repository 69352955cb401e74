"""One fake-tensor trace of a torch.fx graph into its ATen inference graph.

aot_autograd makes the same graph for inference with two traces (one collects metadata on
mutations and aliasing, one records the graph) and runtime wrappers around it; one trace takes
about half the time, and a call of the graph runs without those wrappers.
The graph is the one aot_autograd makes: functionalized, with view ops kept, parameters and
buffers first, then the inputs (``arg0_1``, ...), each node carrying the ``nn_module_stack``
of the torch.fx node it came from. Used only for graphs whose trace needs none of
aot_autograd's wrappers: see ``inference_graph``.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback
from torch._dispatch.python import enable_python_dispatcher
from torch.fx.experimental.proxy_tensor import make_fx
from torch.nn.utils.stateless import _reparametrize_module

_MUTATING = "_"  # aten's in-place overloads end their name with it (add_, copy_)


def inference_graph(gm: fx.GraphModule, inputs: Sequence) -> fx.GraphModule | None:
    """``gm``'s ATen inference graph (returning a tuple) taking its own parameters and buffers
    (in ``named_parameters``, ``named_buffers`` order, duplicates kept, as aot_autograd lifts
    them) then ``inputs``; or None where aot_autograd must trace it: an input that is not a
    plain dense tensor (a subclass, a symbolic size), a graph that still updates an input in
    place after functionalization (its mutation would have to be copied back), or one with a
    value known only at run time (``.item()``, ``nonzero``: aot_autograd refuses those, and
    dynamo breaks the graph there anyway). Call under ``torch.no_grad()``."""
    own = [*gm.named_parameters(remove_duplicate=False), *gm.named_buffers(remove_duplicate=False)]
    names, state = [name for name, _ in own], [tensor for _, tensor in own]
    plain = all(type(x) in (torch.Tensor, torch.nn.Parameter) and x.layout == torch.strided for x in [*state, *inputs])
    if torch.is_grad_enabled() or not plain:
        return None

    def run(*args):
        with fx_traceback.preserve_node_meta(), _reparametrize_module(gm, dict(zip(names, args[:len(names)]))):
            out = fx.Interpreter(gm).run(*args[len(names):])
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)

    with enable_python_dispatcher(), torch.no_grad():  # as aot_autograd traces (BN → its no-training op)
        graph = make_fx(torch.func.functionalize(run, remove="mutations"), tracing_mode="fake")(*state, *inputs)
    if any(_updates_in_place(node) or _data_dependent(node) for node in graph.graph.nodes):
        return None
    graph.graph.eliminate_dead_code()  # ops whose results nothing reads (BatchNorm's reserve buffers)
    graph.recompile()
    return graph


def boxed_caller(compiled: Callable, state: Sequence[torch.Tensor]) -> Callable:
    """``compiled`` (aot_autograd's boxed convention: one list of all graph inputs) called the
    way ``aot_module_simplified``'s result is: with the user's inputs only."""
    state = list(state)

    def forward(*args):
        return compiled([*state, *args])
    return forward


def _updates_in_place(node: fx.Node) -> bool:
    target = node.target
    return node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and (
        target._schema.is_mutable or target.__name__.split(".")[0].endswith(_MUTATING))


def _data_dependent(node: fx.Node) -> bool:
    """Whether the node's value (or a shape in it) is a symbol the trace could not know."""
    values = torch.utils._pytree.tree_leaves(node.meta.get("val"))
    return any(isinstance(v, (torch.SymInt, torch.SymFloat, torch.SymBool)) or (
        isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape)) for v in values)
