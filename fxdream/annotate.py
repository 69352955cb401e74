"""Tie every node of an ATen graph to the layer (module qualified name) it computes.

Forward nodes carry dynamo's ``nn_module_stack``; backward nodes carry
``fwd_nn_module_stack`` (the stack of the forward op they differentiate) and the
autograd ``seq_nr`` they share with that forward op. We use them in that order,
so a backward node of ``layer1.0.conv1`` is annotated ``layer1.0.conv1`` too.
"""
from __future__ import annotations

import operator
import os
import re
from typing import Mapping

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from .rnn_op import rnn_inference
from .sdpa_op import attention_inference

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

_SOURCE_PREFIX = re.compile(r"^L\['[^']*'\]\.?")
_MODULES_ITEM = re.compile(r"_(?:modules|parameters|buffers)\['([^']*)'\]")
_INDEX_ITEM = re.compile(r"\[(\d+)\]")


def qualified_name(dynamo_path: str) -> str:
    """``"L['self'].layer1._modules['0'].conv1"`` → ``"layer1.0.conv1"``."""
    path = _SOURCE_PREFIX.sub("", dynamo_path)
    path = _MODULES_ITEM.sub(r"\1", path)
    path = _INDEX_ITEM.sub(r".\1", path)
    return re.sub(r"\.+", ".", path).strip(".")


def _innermost(stack, prefix: str = "") -> str | None:
    if not stack:
        return None
    path, _type = list(stack.values())[-1]
    return join_names(prefix, qualified_name(path))


def join_names(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix and name else prefix or name


def frame_prefix(dynamo_graph: fx.GraphModule, example_inputs, state_names: Mapping[int, str]) -> str:
    """Where the compiled frame's ``self`` sits in the model.

    After a graph break dynamo compiles a submodule's forward as its own frame, and
    its module paths are relative to that submodule. A lifted parameter tells where it is:
    ``L['self']._modules['linear_q']._parameters['weight']`` is the model's
    ``decoder.attn.linear_q.weight``, so the frame is ``decoder.attn``.
    """
    placeholders = [n for n in dynamo_graph.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        grapharg = node.meta.get("grapharg")
        source = getattr(getattr(grapharg, "source", None), "name", None)
        full = state_names.get(id(value))
        if not source or full is None or not source.startswith("L['self']"):
            continue
        relative = qualified_name(source)
        if full == relative:
            return ""
        if full.endswith("." + relative):
            return full[: -len(relative) - 1]
    return ""


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


def annotate_forward(gm: fx.GraphModule, prefix: str = "") -> dict[int, str]:
    """Set meta["layer"] and phase on a forward graph; return seq_nr → layer for the backward.

    ``prefix`` is the qualified name of the module whose frame dynamo compiled.
    """
    by_seq_nr: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        layer = _innermost(node.meta.get("nn_module_stack"), prefix)
        if layer is None and node.target is operator.getitem:
            layer = node.args[0].meta.get(LAYER) if isinstance(node.args[0], fx.Node) else None
        node.meta[LAYER] = layer if layer is not None else prefix
        node.meta[PHASE] = "fw"
        seq_nr = node.meta.get("seq_nr")
        if seq_nr is not None and layer is not None:
            by_seq_nr.setdefault(seq_nr, layer)
    return by_seq_nr


def annotate_backward(gm: fx.GraphModule, forward_layers: Mapping[int, str], prefix: str = "") -> int:
    """Set meta["layer"] on a backward graph; return how many compute nodes had no forward match."""
    unmapped = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        layer = _innermost(node.meta.get("fwd_nn_module_stack"), prefix)
        if layer is None:
            layer = _accumulation_layer(node)
        if layer is None:
            layer = forward_layers.get(node.meta.get("seq_nr"))
        if layer is None and node.target is operator.getitem:
            layer = node.args[0].meta.get(LAYER)
        if layer is None:
            layer = prefix
            unmapped += is_compute(node)
        node.meta[LAYER] = layer
        node.meta[PHASE] = "bw"
    return unmapped


def _accumulation_layer(node: fx.Node) -> str | None:
    """Autograd's sum of the gradients of a tensor used twice (a residual fan-out) has no
    forward op and a stray seq_nr: it belongs to the innermost module holding both users."""
    if node.target is not torch.ops.aten.add.Tensor or len(node.all_input_nodes) < 2:
        return None
    layers = [a.meta.get(LAYER) for a in node.all_input_nodes]
    if any(layer is None for layer in layers):
        return None
    return ".".join(os.path.commonprefix([layer.split(".") for layer in layers]))  # by whole name parts


def _val(arg):
    return arg.meta.get("val") if isinstance(arg, fx.Node) else arg


def node_flops(node: fx.Node) -> int:
    """FLOPs of one node from torch.utils.flop_counter's formulas on its fake tensors."""
    packet = getattr(node.target, "overloadpacket", None)
    if packet in _RNN_OPS:
        return _rnn_flops(node)
    if packet in _SDPA_OPS:
        return _sdpa_flops(node)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0
    args = torch.utils._pytree.tree_map(_val, node.args)
    kwargs = torch.utils._pytree.tree_map(_val, node.kwargs)
    try:
        return int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # a formula that cannot read symbolic or missing shapes
        return 0


_SDPA_OPS = {getattr(torch.ops.aten, name) for name in ("scaled_dot_product_attention",
                                                       "_scaled_dot_product_flash_attention_for_cpu")
             if hasattr(torch.ops.aten, name)}
_SDPA_OPS.add(attention_inference.overloadpacket)


def _sdpa_flops(node: fx.Node) -> int:
    """SDPA forward (no formula in flop_counter for the composite op and the CPU kernel): q·kᵀ
    and probs·v, 2·b·h·s·t·(d + dv) FLOPs (the softmax is left out, as flop_counter does)."""
    q, k, v = (_val(a) for a in node.args[:3])
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, k, v)):
        return 0
    batch = q.numel() // (q.shape[-2] * q.shape[-1])
    return int(2 * batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1]))


_RNN_OPS = {getattr(torch.ops.aten, name) for name in ("lstm", "gru", "rnn_tanh", "rnn_relu", "mkldnn_rnn_layer",
                                                      "_cudnn_rnn") if hasattr(torch.ops.aten, name)}
_RNN_OPS.add(rnn_inference.overloadpacket)


def _rnn_flops(node: fx.Node) -> int:
    """RNN ops (no formula in flop_counter): every weight matrix (4H×I, 4H×H for an LSTM,
    per layer and direction) multiplies every sequence element: 2·rows·cols FLOPs each."""
    x = _val(node.args[0])
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        return 0
    tokens = x.shape[0] * (x.shape[1] if x.dim() == 3 else 1)
    weights = [w for w in torch.utils._pytree.tree_leaves(torch.utils._pytree.tree_map(_val, node.args[1:]))
               if isinstance(w, torch.Tensor) and w.dim() == 2 and w is not x]
    return int(sum(2 * tokens * w.shape[0] * w.shape[1] for w in weights))


# (index of num_layers, index of batch_first) in each RNN op's arguments
_RNN_LAYOUT_ARGS = {getattr(torch.ops.aten, name): (4, 8) for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")}
_RNN_LAYOUT_ARGS.update({rnn_inference.overloadpacket: (5, 7), torch.ops.aten._cudnn_rnn: (9, 10)})


def rnn_sequential_steps(node: fx.Node) -> int:
    """Time steps × layers of an RNN op: the recurrence runs them one after another, whatever
    the FLOPs (0 for other ops, and for oneDNN's per-layer op, timed on the CPU anyway)."""
    where = _RNN_LAYOUT_ARGS.get(getattr(node.target, "overloadpacket", None))
    x = _val(node.args[0]) if node.args else None
    if where is None or not isinstance(x, torch.Tensor) or len(node.args) <= max(where):
        return 0
    layers, batch_first = node.args[where[0]], node.args[where[1]]
    if not isinstance(layers, int) or x.dim() not in (2, 3):
        return 0
    steps = x.shape[1] if x.dim() == 3 and batch_first else x.shape[0]
    return int(steps) * layers
