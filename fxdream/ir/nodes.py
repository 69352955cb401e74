"""What a node of an ATen FX graph is: its op, its schema arguments, its example value, its bytes.

The meta keys fxdream sets on nodes are named here, so every stage reads the same ones."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from fxdream.ir.tensors import tensor_bytes

LAYER = "layer"              # qualified module name; "" is the model itself


PHASE = "fxdream.phase"      # "fw" | "bw"


ROOT_LAYER_LABEL = "(model)"  # how the root layer "" is shown in tables


# backward output node meta: positions of the outputs that are gradients of model parameters
# (after a graph break a subgraph also returns the gradient of its activation input)
PARAMETER_GRADIENTS = "fxdream.parameter_gradients"


# Ops that only reinterpret metadata: they cost dispatch but no kernel.
VIEW_OPS = frozenset({
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.t", "aten.transpose",
    "aten.permute", "aten.expand", "aten.squeeze", "aten.unsqueeze", "aten.detach",
    "aten.alias", "aten.as_strided", "aten.slice", "aten.select", "aten.split",
    "aten.split_with_sizes", "aten.unbind", "aten.chunk", "aten.narrow",
    "aten.view_as", "aten.expand_as", "aten.flatten", "aten.lift_fresh",
})


def op_name(node: fx.Node) -> str:
    """``aten.convolution`` for ``aten.convolution.default``; the Python name otherwise."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet is not None:
        return str(packet)
    return getattr(node.target, "__name__", str(node.target))


def schema_arguments(node: fx.Node):
    """(schema argument, the value the call gives it, positionally or by keyword; None if it
    gives none) for a call of an op with a schema; nothing for any other node."""
    schema = getattr(node.target, "_schema", None)
    for i, argument in enumerate(schema.arguments if schema is not None else ()):
        yield argument, node.args[i] if i < len(node.args) else node.kwargs.get(argument.name)


def is_compute(node: fx.Node) -> bool:
    """A call that does work on tensors (not a placeholder, output, getitem or view)."""
    if node.op not in ("call_function", "call_method", "call_module"):
        return False
    if node.target is operator.getitem:
        return False
    return op_name(node) not in VIEW_OPS


def value_of(arg):
    """The value an argument stands for: a node's example value (``meta["val"]``, a fake tensor;
    None where it has none), anything else (a constant: an int, a list, None) as itself."""
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def is_view(node: fx.Node) -> bool:
    return node.target is operator.getitem or op_name(node) in VIEW_OPS


def draws_random_numbers(node: fx.Node) -> bool:
    """An op tagged ``nondeterministic_seeded`` (dropout, ``randn_like``, ``bernoulli``): every
    call is a new draw, and which number lands in which element follows its output's memory order."""
    return torch.Tag.nondeterministic_seeded in getattr(node.target, "tags", ())


def arg_values(node: fx.Node):
    """(args, kwargs) of ``node`` with every node replaced by its example value."""
    return tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, (node.args, node.kwargs))


DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16",
               torch.float64: "float64"}


def node_bytes(node: fx.Node) -> int:
    """Bytes a kernel reads and writes: its tensor inputs plus its outputs."""
    return tensor_bytes(arg_values(node)) + tensor_bytes(node.meta.get("val"))


def node_dtype(node: fx.Node) -> str:
    leaves, _ = tree_flatten(node.meta.get("val"))
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            return DTYPE_NAMES.get(t.dtype, "float32")
    return "float32"


def fake_value(node: fx.Node):
    """``node``'s value recomputed from its inputs' fake tensors (``meta["val"]``) under their
    fake mode: shapes, dtypes and strides, no data; None where no input carries a fake tensor."""
    vals = [a.meta.get("val") for a in node.all_input_nodes]
    mode = next((v.fake_mode for v in vals if hasattr(v, "fake_mode")), None)
    if mode is None:
        return None
    args, kwargs = tree_map(value_of, (node.args, node.kwargs))
    with mode:
        return node.target(*args, **kwargs)
