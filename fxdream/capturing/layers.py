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

from fxdream.ir.nodes import LAYER, PHASE, is_compute

# the frame's local the path starts from: ``self`` by any name, or ``args[0]`` where a decorator
# wraps ``forward`` in ``def wrapper(*args, **kwargs)`` (transformers' ``LlamaForCausalLM``)
_SOURCE_PREFIX = re.compile(r"^L\['(?:args'\]\[0|[^']*')\]\.?")
_MODULES_ITEM = re.compile(r"_(?:modules|parameters|buffers)\['([^']*)'\]")
_INDEX_ITEM = re.compile(r"\[(\d+)\]")
_GETATTR = re.compile(r"getattr\(([^()]*?), '([^']*)'\)")
# a parameter or buffer of the frame's ``self``, whatever the method names it (``def forward(s, x)``)
_STATE_OF_A_LOCAL = re.compile(r"^L\['[^']*'\]\._(?:modules|parameters|buffers)\[|^L\['self'\]\.|^L\['args'\]\[0\]\.")


def qualified_name(dynamo_path: str) -> str:
    """``"L['self'].layer1._modules['0'].conv1"`` → ``"layer1.0.conv1"``; a getattr dynamo wrote
    out (``"getattr(L['self'].ex, '0')"``) is read as the attribute."""
    path = dynamo_path
    while _GETATTR.search(path):
        path = _GETATTR.sub(r"\1.\2", path)
    path = _SOURCE_PREFIX.sub("", path)
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


def without_root(name: str, root: str) -> str:
    """``name`` as the user's model names it, where the captured module wraps that model as its
    submodule ``root`` (keyword flags bound by ``WithKeywords``: "model"); as it is otherwise."""
    if not root:
        return name
    if name == root:
        return ""
    return name[len(root) + 1:] if name.startswith(root + ".") else name


def frame_anchor(dynamo_graph: fx.GraphModule, example_inputs,
                 state_names: Mapping[int, str]) -> tuple[str, str] | None:
    """(where the compiled frame's ``self`` sits in the model, the path of a parameter of it
    below ``self``), or None where no lifted parameter tells.

    After a graph break dynamo compiles a submodule's forward as its own frame, and
    its module paths are relative to that submodule. A lifted parameter tells where it is:
    ``L['self']._modules['linear_q']._parameters['weight']`` is the model's
    ``decoder.attn.linear_q.weight``, so the frame is ``decoder.attn`` (and the parameter
    ``linear_q.weight`` below it, by which a later call on another instance is placed).
    """
    placeholders = [n for n in dynamo_graph.graph.nodes if n.op == "placeholder"]
    for node, value in zip(placeholders, example_inputs):
        grapharg = node.meta.get("grapharg")
        source = getattr(getattr(grapharg, "source", None), "name", None)
        full = state_names.get(id(value))
        if not source or full is None or not _STATE_OF_A_LOCAL.match(source):  # the frame's ``self``, by any name
            continue
        relative = qualified_name(source)
        if full == relative:
            return "", relative
        if full.endswith("." + relative):
            return full[: -len(relative) - 1], relative
    return None


def renamed_layer(layer: str, old: str, new: str) -> str:
    """``layer`` of a block named ``old`` as the same layer of the block named ``new``."""
    if layer == old:
        return new
    return new + layer[len(old):] if old and layer.startswith(old + ".") else layer


def annotate_forward(gm: fx.GraphModule, prefix: str = "", root: str = "") -> dict[int, str]:
    """Set meta["layer"] and phase on a forward graph; return seq_nr → layer for the backward.

    ``prefix`` is the qualified name of the module whose frame dynamo compiled; ``root``, where
    the captured module holds the user's model (``without_root``).
    """
    by_seq_nr: dict[int, str] = {}
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        layer = _innermost(node.meta.get("nn_module_stack"), prefix)
        layer = without_root(layer, root) if layer is not None else None
        if layer is None and node.target is operator.getitem:  # its tuple's layer: named already
            layer = node.args[0].meta.get(LAYER) if isinstance(node.args[0], fx.Node) else None
        node.meta[LAYER] = layer if layer is not None else without_root(prefix, root)
        node.meta[PHASE] = "fw"
        seq_nr = node.meta.get("seq_nr")
        if seq_nr is not None and layer is not None:
            by_seq_nr.setdefault(seq_nr, node.meta[LAYER])
    return by_seq_nr


def annotate_backward(gm: fx.GraphModule, forward_layers: Mapping[int, str], prefix: str = "",
                      root: str = "") -> int:
    """Set meta["layer"] on a backward graph; return how many compute nodes had no forward match
    (``forward_layers`` as ``annotate_forward`` returned them: without ``root`` already)."""
    unmapped = 0
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        layer = _innermost(node.meta.get("fwd_nn_module_stack"), prefix)
        layer = without_root(layer, root) if layer is not None else None
        if layer is None:  # from its inputs' layers, named already
            layer = _accumulation_layer(node)
        if layer is None:
            layer = forward_layers.get(node.meta.get("seq_nr"))
        if layer is None and node.target is operator.getitem:
            layer = node.args[0].meta.get(LAYER)
        if layer is None:
            layer = without_root(prefix, root)
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


