"""Prepacked graphs call oneDNN directly, as inductor's freezing emits them.

``conv_fused_inference.prepacked`` is a Python wrapper, whose Python costs host time on every call;
``call_onednn_directly`` replaces it by the oneDNN op it calls, and accumulates a residual
add in place where nobody reads the residual later (one allocation and one pass over the
output fewer)."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch import Tensor

from fxdream.ir.aliasing import aliases_input
from fxdream.ops.fused_conv import (
    ONEDNN_CONV,
    ONEDNN_CONV_ADD_,
    channels_last_format,
    conv_fused_inference_prepacked,
    onednn_unary,
)


def _residual_is_free(node, other, order: dict) -> bool:
    """Whether ``node`` may overwrite ``other``: a value computed in this graph (not an input,
    a constant or a view of one), channels_last like the conv's output, and read by nobody
    after ``node`` (``order``: node → position in the graph)."""
    value = other.meta.get("val") if isinstance(other, fx.Node) else None
    if other.op != "call_function" or not isinstance(value, Tensor):
        return False
    channels_last = channels_last_format(value.dim())  # 2-d and 3-d convs
    if channels_last is None or not value.is_contiguous(memory_format=channels_last):
        return False
    source = other.args[0] if other.target is operator.getitem else other  # max_pool's (values, indices)
    if source.target is not ONEDNN_CONV_ADD_ and (  # that one's own residual was checked likewise
            getattr(source.target, "_schema", None) is None or aliases_input(source)):
        return False  # may alias an input (a view): never overwrite it
    if _aliases(node.args[0], other):
        return False  # the conv reads it too (y = relu(conv(y) + y))
    return all(order[u] < order[node] for u in _readers(other) if u is not node)


def _may_alias_input(n) -> bool:
    """Whether ``n``'s result may share memory with one of its inputs (a view, getitem, in-place)."""
    return n.target is operator.getitem or (n.op == "call_function" and aliases_input(n))


def _readers(other) -> set:
    """Every node that reads ``other``'s memory: its users and, through views, theirs."""
    found, todo = set(), [other]
    while todo:
        for u in todo.pop().users:
            if u not in found:
                found.add(u)
                if _may_alias_input(u):
                    todo.append(u)
    return found


def _aliases(node, other) -> bool:
    """Whether ``node`` is ``other`` or a view of it (through ops whose result aliases an input)."""
    todo = [node]
    while todo:
        n = todo.pop()
        if n is other:
            return True
        if _may_alias_input(n):
            todo.extend(a for a in n.args if isinstance(a, fx.Node))
    return False


def call_onednn_directly(gm) -> int:
    """Replace ``conv_fused_inference.prepacked`` nodes by the oneDNN ops they call, as
    inductor's freezing emits them: no Python between the graph and oneDNN, and a residual
    add accumulated in place into a residual nobody reads later (one allocation and one pass
    over the output fewer). Returns how many were replaced.

    Each call is first tried on real tensors of its arguments' shapes and strides: oneDNN
    rejects some layouts ("could not create a memory" on torch 2.11 for a channels_last
    residual of 1x1 spatial size), and those keep the wrapper, whose fallback handles them."""
    replaced, order = 0, {n: i for i, n in enumerate(gm.graph.nodes)}  # targets change, not the order
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not conv_fused_inference_prepacked:
            continue
        x, w, b, other, stride, padding, dilation, groups, act = node.args
        if x.meta["val"].dim() == 3:
            continue  # a 1-d conv: the wrapper runs it as 2-d over height 1
        attrs = (list(padding), list(stride), list(dilation), groups)
        if other is None:
            target, args = ONEDNN_CONV, (x, w, b, *attrs, *onednn_unary(act), "")
        elif _residual_is_free(node, other, order):
            target, args = ONEDNN_CONV_ADD_, (other, x, w, b, *attrs, "add", None,
                                              None if act == "none" else act, [], None)
        else:
            continue
        if not _runs_on_real_tensors(gm, target, args):
            continue
        node.target, node.args = target, args
        replaced += 1
    if replaced:
        gm.recompile()
    return replaced


def _runs_on_real_tensors(gm, target, args) -> bool:
    """Whether ``target`` runs on tensors of its arguments' shapes and strides, tried once per
    process for each distinct call (a deep net repeats its blocks' convs).

    At full size: the trial also builds the oneDNN primitive the graph's call will use, so the
    graph's first timed run in context is not a cold one. Trials on tensors cut to a small output
    would save little build time, and the cold first run would predict the prepacked graph too
    slow."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    layouts = trial_layouts(gm, args)
    key = (target, *(_signature(a) for a in layouts))
    if key not in _TRIED:
        with unset_fake_temporarily(), torch.no_grad():
            try:
                target(*[torch.empty_strided(*a[:2], dtype=a[2]).zero_() if isinstance(a, TrialTensor) else a
                         for a in layouts])  # zeros: it runs, the values do not matter
                _TRIED[key] = True
            except RuntimeError:
                _TRIED[key] = False
    return _TRIED[key]


_TRIED: dict[tuple, bool] = {}  # a trial's op and argument layouts → whether it ran


class TrialTensor(tuple):
    """(shape, strides, dtype): a tensor a trial makes."""


def trial_layouts(gm, args) -> list:
    """A trial call's arguments: constants (weights) as they are, each activation as the
    ``TrialTensor`` of its fake value."""
    def layout(a):
        if not isinstance(a, fx.Node):
            return a
        if a.op == "get_attr":
            return getattr(gm, a.target)
        v = a.meta["val"]
        return TrialTensor((tuple(v.shape), tuple(v.stride()), v.dtype))
    return [layout(a) for a in args]


def _signature(a):
    if isinstance(a, TrialTensor):
        return tuple(a)
    if isinstance(a, Tensor):
        return ("mkldnn" if a.is_mkldnn else a.stride(), tuple(a.shape), a.dtype)
    return tuple(a) if isinstance(a, list) else a
