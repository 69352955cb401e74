"""FLOPs of one node: torch.utils.flop_counter's formulas, plus SDPA and RNN ops it has none for.

fxdream's own whole ops (``fxdream::rnn_inference``, ``fxdream::attention_inference``) are
known here by name, so this module needs no import of the ops that define them."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry

from fxdream.ir.nodes import op_name, value_of


GEMM_OPS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.linear", "aten._scaled_mm"})
CONV_OPS = frozenset({"aten.convolution", "aten.convolution_backward", "aten.cudnn_convolution",
                      "aten._convolution", "fxdream.conv_fused_inference", "fxdream.conv_bias_relu",
                      "fxdream.conv_bias_add_relu"})
BATCH_NORM_OPS = frozenset({"aten.native_batch_norm", "aten._native_batch_norm_legit",
                            "aten._native_batch_norm_legit_functional", "aten._native_batch_norm_legit_no_training",
                            "aten.native_batch_norm_backward", "aten.cudnn_batch_norm",
                            "aten.cudnn_batch_norm_backward",
                            "aten.miopen_batch_norm", "aten.miopen_batch_norm_backward"})
KERNEL_CLASSES = ("conv", "gemm", "batch_norm", "other")


def kernel_class(node: fx.Node) -> str:
    """"conv" (convolutions and their gradients), "gemm" (matrix products, attention),
    "batch_norm" (batch norm and its gradient: per-channel reductions over the batch) or
    "other" (pointwise, copies, other norms and reductions: memory-bound). Libraries reach
    different shares of the roofline on each (``DeviceSpec.roofline_share``)."""
    name = op_name(node)
    if name in CONV_OPS:
        return "conv"
    if name in GEMM_OPS or name in _SDPA_OPS or "scaled_dot_product" in name:
        return "gemm"
    if name in BATCH_NORM_OPS:
        return "batch_norm"
    return "other"


def node_flops(node: fx.Node) -> int:
    """FLOPs of one node from torch.utils.flop_counter's formulas on its fake tensors."""
    packet = getattr(node.target, "overloadpacket", None)
    if op_name(node) in _RNN_OPS:
        return _rnn_flops(node)
    if op_name(node) in _SDPA_OPS:
        return _sdpa_flops(node)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0
    args = torch.utils._pytree.tree_map(value_of, node.args)
    kwargs = torch.utils._pytree.tree_map(value_of, node.kwargs)
    try:
        return int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # a formula that cannot read symbolic or missing shapes
        return 0


_SDPA_OPS = frozenset({"aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
                       "fxdream.attention_inference"})


def _sdpa_flops(node: fx.Node) -> int:
    """SDPA forward (no formula in flop_counter for the composite op and the CPU kernel): q·kᵀ
    and probs·v, 2·b·h·s·t·(d + dv) FLOPs (the softmax is left out, as flop_counter does)."""
    q, k, v = (value_of(a) for a in node.args[:3])
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, k, v)):
        return 0
    batch = q.numel() // (q.shape[-2] * q.shape[-1])
    return int(2 * batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1]))


_RNN_OPS = frozenset({"aten.lstm", "aten.gru", "aten.rnn_tanh", "aten.rnn_relu", "aten.mkldnn_rnn_layer",
                      "aten._cudnn_rnn", "fxdream.rnn_inference"})


def _rnn_flops(node: fx.Node) -> int:
    """RNN ops (no formula in flop_counter): every weight matrix (4H×I, 4H×H for an LSTM,
    per layer and direction) multiplies every sequence element: 2·rows·cols FLOPs each."""
    x = value_of(node.args[0])
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        return 0
    tokens = x.shape[0] * (x.shape[1] if x.dim() == 3 else 1)
    weights = [w for w in torch.utils._pytree.tree_leaves(torch.utils._pytree.tree_map(value_of, node.args[1:]))
               if isinstance(w, torch.Tensor) and w.dim() == 2 and w is not x]
    return int(sum(2 * tokens * w.shape[0] * w.shape[1] for w in weights))


# (index of num_layers, index of batch_first) in each RNN op's arguments
_RNN_LAYOUT_ARGS = {**{f"aten.{name}": (4, 8) for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")},
                    "fxdream.rnn_inference": (5, 7), "aten._cudnn_rnn": (9, 10)}


def rnn_sequential_steps(node: fx.Node) -> int:
    """Time steps × layers of an RNN op: the recurrence runs them one after another, whatever
    the FLOPs (0 for other ops, and for oneDNN's per-layer op, timed on the CPU anyway)."""
    where = _RNN_LAYOUT_ARGS.get(op_name(node))
    x = value_of(node.args[0]) if node.args else None
    if where is None or not isinstance(x, torch.Tensor) or len(node.args) <= max(where):
        return 0
    layers, batch_first = node.args[where[0]], node.args[where[1]]
    if not isinstance(layers, int) or x.dim() not in (2, 3):
        return 0
    steps = x.shape[1] if x.dim() == 3 and batch_first else x.shape[0]
    return int(steps) * layers
