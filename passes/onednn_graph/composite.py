"""The graph oneDNN Graph is given: an FX graph's parameters made constants and its ATen ops
written back in the composite form TorchScript's oneDNN Graph bridge recognises.

``convolution`` → ``conv2d`` (1-d, 3-d alike), ``_native_batch_norm_legit_no_training`` →
``batch_norm``, ``native_layer_norm`` → ``layer_norm``, ``max_pool2d_with_indices`` →
``max_pool2d``, ``addmm(b, x, t(w))`` and ``addmm(b, x, w)`` of a constant ``w`` → ``linear``, a
``cat`` onto an empty KV cache without it; a tanh GELU as its formula, which the bridge would
run in erf form; a layer norm without weight or bias given constant ones and zeros.
"""
from __future__ import annotations

import math
import operator
import warnings

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxdream.ir.tensors import has_symbols
from fxdream.pass_api import LAYER, PassContext, copy_graph_module, frozen_value

aten = torch.ops.aten
CONVOLUTIONS = {3: F.conv1d, 4: F.conv2d, 5: F.conv3d}  # by the input's dimensions
FIRST_ITEM_OPS = (F.batch_norm, F.max_pool2d, F.layer_norm)  # composite forms of ops whose first item was read


def _only_first_item_read(node: fx.Node) -> bool:
    return all(u.target is operator.getitem and u.args[1] == 0 for u in node.users)


def _pool_arguments(x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False) -> tuple:
    """``max_pool2d``'s arguments with every size as a pair: oneDNN Graph rejects the one-element
    or empty lists ATen's defaults leave ("could not set attribute to the op")."""
    def pair(v):
        v = [v] if isinstance(v, int) else list(v)
        return v * 2 if len(v) == 1 else v
    kernel = pair(kernel)
    return x, kernel, pair(stride) if stride else kernel, pair(padding), pair(dilation), ceil_mode


def _composite(node: fx.Node):
    """(target, args[, kwargs]) of ``node`` in the composite form oneDNN Graph fuses, or None to keep it."""
    if node.target is aten.convolution.default:
        x, w, b, stride, padding, dilation, transposed, _, groups = node.args
        conv = CONVOLUTIONS.get(node.meta["val"].dim())
        if transposed or conv is None:
            return None
        return conv, (x, w, b, stride, padding, dilation, groups)
    if node.target is aten._native_batch_norm_legit_no_training.default and _only_first_item_read(node):
        x, w, b, mean, var, momentum, eps = node.args
        return F.batch_norm, (x, mean, var, w, b, False, momentum, eps)
    if node.target is aten.max_pool2d_with_indices.default and _only_first_item_read(node):
        return F.max_pool2d, _pool_arguments(*node.args)
    if node.target is aten.native_layer_norm.default and _only_first_item_read(node):
        return F.layer_norm, tuple(node.args)
    if node.target is aten.cat.default and (empty := _empty_operands(node)):
        kept = [t for t in node.args[0] if t not in empty]
        if not all(isinstance(t, fx.Node) and _dtype(t) == _dtype(node) for t in kept):
            return None  # the empty operand takes part in cat's type promotion
        if len(kept) == 1:  # a fresh contiguous tensor, as cat makes
            return aten.clone.default, (kept[0],), {"memory_format": torch.contiguous_format}
        return (aten.cat.default, (kept, *node.args[1:])) if kept else None
    if node.target is aten.addmm.default and len(node.args) == 3 and not node.kwargs:
        bias, x, wt = node.args
        if isinstance(wt, fx.Node) and wt.target is aten.t.default and len(wt.users) == 1:
            return F.linear, (x, wt.args[0], bias)
    return None


def _dtype(node: fx.Node) -> torch.dtype | None:
    value = node.meta.get("val")
    return value.dtype if isinstance(value, torch.Tensor) else None


def _empty_operands(node: fx.Node) -> list[fx.Node]:
    """A ``cat``'s operands without elements (an empty KV cache the first step appends to): the
    fuser fails to compile a partition holding one ("partition compile failed")."""
    return [t for t in node.args[0] if isinstance(t, fx.Node) and isinstance(t.meta.get("val"), torch.Tensor)
            and t.meta["val"].numel() == 0]


def composite_graph(gm: fx.GraphModule, ctx: PassContext) -> tuple[fx.GraphModule, list[fx.Node]] | None:
    """``gm`` with its parameters as constants and its ops in composite form, taking only its
    activations, returning the flat tuple of its outputs; and those activations' placeholders
    in ``gm``. None where a placeholder is neither a constant nor a tensor, a size is symbolic,
    or an output is not a tensor an op computes."""
    if any(has_symbols(n.meta.get("val")) for n in gm.graph.nodes):
        return None  # dynamo's dynamic shapes: a trace would fix the example's sizes
    new = copy_graph_module(gm)
    found = _constants_made_attributes(new, gm, ctx)
    if found is None or not _outputs_are_computed_tensors(new):
        return None
    root, activations = found
    _constant_weights_transposed(new.graph, root)
    _layer_norms_given_affine(new.graph, root)
    _tanh_gelus_written_out(new.graph)
    _write_in_composite_form(new.graph)
    new.graph.output_node().args = (tuple(dict.fromkeys(flat_outputs(new.graph))),)
    return fx.GraphModule(root, new.graph), activations


def _constants_made_attributes(new: fx.GraphModule, gm: fx.GraphModule, ctx: PassContext):
    """(a module holding ``new``'s constants, ``gm``'s activation placeholders): every parameter
    placeholder of ``new`` (a copy of ``gm``) becomes a ``get_attr`` of that module, every
    ``get_attr`` reads it there. None where an activation is not a tensor."""
    root, activations, originals = torch.nn.Module(), [], {n.name: n for n in gm.graph.nodes}
    for node in list(new.graph.nodes):
        if node.op == "get_attr":
            root.register_buffer(node.target.replace(".", "_"), frozen_value(originals[node.name], ctx))
            node.target = node.target.replace(".", "_")
        elif node.op == "placeholder":
            value = frozen_value(originals[node.name], ctx)
            if value is None:
                if not isinstance(node.meta.get("val"), torch.Tensor):
                    return None
                activations.append(originals[node.name])
                continue
            name = f"constant_{len(root._buffers)}"
            root.register_buffer(name, value.detach())
            with new.graph.inserting_before(node), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the attribute is on ``root``, not on the copy
                constant = new.graph.get_attr(name)
            constant.meta["val"] = node.meta.get("val")  # its shape: rewrites read it
            node.replace_all_uses_with(constant)
            new.graph.erase_node(node)
    return root, activations


def _constant_weights_transposed(graph: fx.Graph, root: torch.nn.Module) -> None:
    """``addmm(b, x, w)`` with a constant ``w`` of shape (in, out) (Hugging Face's ``Conv1D``)
    written ``addmm(b, x, t(wᵀ))`` with ``wᵀ`` a new contiguous constant, the form ``_composite``
    makes a ``linear``: the fuser fails on ``addmm`` ("vector::_M_range_check")."""
    for node in list(graph.nodes):
        weight = node.args[2] if node.target is aten.addmm.default and len(node.args) == 3 else None
        if not isinstance(weight, fx.Node) or weight.op != "get_attr" or node.kwargs:
            continue
        name = f"{weight.target}_transposed"
        if not hasattr(root, name):
            root.register_buffer(name, getattr(root, weight.target).t().contiguous())
        with graph.inserting_before(node), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the attribute is on ``root``, not on the graph's module
            transposed = graph.call_function(aten.t.default, (graph.get_attr(name),))
        node.args = (node.args[0], node.args[1], transposed)
        if not weight.users:
            graph.erase_node(weight)


def _layer_norms_given_affine(graph: fx.Graph, root: torch.nn.Module) -> None:
    """A ``native_layer_norm`` without weight or bias (``elementwise_affine=False``, a bare
    ``F.layer_norm``) given constant ones and zeros: the fuser fails on the missing inputs
    ("vector::_M_range_check") and declined the whole graph; x·1 + 0 is the same value."""
    for node in list(graph.nodes):
        if node.target is not aten.native_layer_norm.default or len(node.args) != 5:
            continue
        x, shape, weight, bias, eps = node.args
        value = x.meta.get("val") if isinstance(x, fx.Node) else None
        if (weight is not None and bias is not None) or not isinstance(value, torch.Tensor):
            continue
        made = []
        for given, fill in ((weight, 1.0), (bias, 0.0)):
            if given is not None:
                made.append(given)
                continue
            name = f"layer_norm_{'weight' if fill else 'bias'}_{node.name}"
            root.register_buffer(name, torch.full(tuple(shape), fill, dtype=value.dtype))
            with graph.inserting_before(node), warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the attribute is on ``root``, not on the graph's module
                made.append(graph.get_attr(name))
        node.args = (x, shape, made[0], made[1], eps)


def _tanh_gelus_written_out(graph: fx.Graph) -> None:
    """Each ``gelu(x, approximate="tanh")`` written as its formula, 0.5·x·(1 + tanh(√(2/π)·(x +
    0.044715·x³))): TorchScript's bridge hands oneDNN Graph a GELU without its ``approximate``, and
    oneDNN runs the erf form (``eltwise_gelu_erf``, 2e-4 off), so the graph would fail the check
    against its own outputs; the formula's ops it fuses as post-ops of the op before, as it does
    GPT-2's GELU, written out by the model."""
    for node in list(graph.nodes):
        if node.target is not aten.gelu.default or node.kwargs.get("approximate", "none") != "tanh":
            continue
        x = node.args[0]
        with graph.inserting_before(node):
            cube = graph.call_function(aten.pow.Tensor_Scalar, (x, 3))
            inner = graph.call_function(aten.add.Tensor, (x, graph.call_function(aten.mul.Tensor, (cube, 0.044715))))
            scaled = graph.call_function(aten.mul.Tensor, (inner, math.sqrt(2 / math.pi)))
            one_plus = graph.call_function(aten.add.Tensor, (graph.call_function(aten.tanh.default, (scaled,)), 1))
            gelu = graph.call_function(aten.mul.Tensor, (graph.call_function(aten.mul.Tensor, (x, 0.5)), one_plus))
        gelu.meta["val"] = node.meta.get("val")
        node.replace_all_uses_with(gelu)
        graph.erase_node(node)


def _write_in_composite_form(graph: fx.Graph) -> None:
    """Each op ``_composite`` knows replaced by its composite form (a batch norm's or a pooling's
    first item read from the composite op itself), the transposes ``linear`` took over dropped."""
    for node in list(graph.nodes):
        rewrite = _composite(node) if node.op == "call_function" else None
        if rewrite is None:
            continue
        with graph.inserting_before(node):
            replacement = graph.call_function(*rewrite)
        if LAYER in node.meta:  # the layer a decline names
            replacement.meta[LAYER] = node.meta[LAYER]
        for user in list(node.users) if rewrite[0] in FIRST_ITEM_OPS else ():
            user.replace_all_uses_with(replacement)
            graph.erase_node(user)
        node.replace_all_uses_with(replacement)
        graph.erase_node(node)
    for node in reversed(list(graph.nodes)):
        if node.op == "call_function" and not node.users and node.target is aten.t.default:
            graph.erase_node(node)


def flat_outputs(graph: fx.Graph) -> tuple:
    """What ``graph`` returns, as a flat tuple (a single value as a tuple of one)."""
    returned = graph.output_node().args[0]
    return tuple(returned) if isinstance(returned, (tuple, list)) else (returned,)


def _outputs_are_computed_tensors(gm: fx.GraphModule) -> bool:
    return all(isinstance(o, fx.Node) and o.op == "call_function" and isinstance(o.meta.get("val"), torch.Tensor)
               for o in flat_outputs(gm.graph))
