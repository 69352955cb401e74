"""Fused convolution ops: conv + bias (+ residual add) + ReLU as one kernel.

The Flux seed (FluxML/Flux.jl#558): a separate bias broadcast and activation cost more
than the convolution itself, and their gradients a slow map-reduce. Here the forward is
one oneDNN call on CPU (``mkldnn._convolution_pointwise``, a ReLU post-op, plus an
``add`` post-op for the residual) and one cuDNN call on CUDA
(``cudnn_convolution_relu`` / ``cudnn_convolution_add_relu``); the backward is
``threshold_backward`` and ONE ``convolution_backward`` that returns the input, weight
and bias gradients together (the bias gradient is a reduction inside that call).

Two families:

* ``fxdream::conv_bias_relu`` and ``fxdream::conv_bias_add_relu``: trainable
  (``torch.library.custom_op`` + ``register_fake`` + ``register_autograd``).
* ``fxdream::conv_fused_inference``: inference only (no autograd), defined with a plain
  ``torch.library.Library`` because a ``custom_op`` wrapper's Python costs several times a
  Library op's on every call, and a model calls it once per convolution. Its ``.prepacked``
  overload takes a weight prepacked once by ``prepack_conv_weight`` (oneDNN's blocked layout at
  a known input size, as inductor's freezing does), which is why it is also registered for the ``MkldnnCPU`` key.

A prepacked graph then calls oneDNN directly (``onednn_direct.call_onednn_directly``): the wrapper's
Python costs host time on every conv call, and a residual add can accumulate in place.

A 1-d conv runs as a 2-d one of height 1 (oneDNN's add post-op is 2-d/3-d, and its 2-d kernels
are faster); in channels_last there, its activations are "NLC": (N, C, L) with strides (L·C, 1, C).

Values: equal to aten conv + bias + activation up to float32 rounding, not bit for bit: the
bias and activation as oneDNN post-ops, channels_last or prepacked weights change the order of
the summation (max abs diff ~4e-7 on outputs of magnitude ~1, ~2e-5 at ~10).
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch.utils.flop_counter import conv_flop_count, register_flop_formula

from fxdream.ir.tensors import size_hint

Tensor = torch.Tensor
# oneDNN's unary post-op name → the ATen op it computes (the unfused reference and fallback)
# ("hardtanh:LO,HI" carries its bounds: ReLU6 is "hardtanh:0.0,6.0")
UNARY = {"relu": torch.ops.aten.relu.default, "swish": torch.ops.aten.silu.default,
         "hardswish": torch.ops.aten.hardswish.default, "sigmoid": torch.ops.aten.sigmoid.default,
         "tanh": torch.ops.aten.tanh.default, "hardtanh": torch.ops.aten.hardtanh.default}


def onednn_unary(act: str) -> tuple[str, list[float]]:
    """("hardtanh", [0.0, 6.0]) from "hardtanh:0.0,6.0"; (name, []) for the others."""
    name, _, bounds = act.partition(":")
    return name, [float(v) for v in bounds.split(",")] if bounds else []


def _check_act(act: str) -> None:
    name, scalars = onednn_unary(act)
    if not (name == "none" or name in UNARY) or (len(scalars) != 2 if name == "hardtanh" else scalars):
        raise ValueError(f"act must be 'none', one of {sorted(UNARY)} or 'hardtanh:LO,HI', got {act!r}")


# --- helpers -------------------------------------------------------------------------------
def channels_last_format(dim: int):
    """The channels-last memory format of a ``dim``-d tensor (2-d and 3-d convs), or None."""
    return {4: torch.channels_last, 5: torch.channels_last_3d}.get(dim)


def _suggests_channels_last(t: Tensor) -> bool:
    """ATen's ``suggest_memory_format`` (what oneDNN and cuDNN choose the output layout by), by its
    Python mirror in torch._prims_common (private; isolated here)."""
    from torch._prims_common import suggest_memory_format
    fmt = channels_last_format(t.dim())
    return fmt is not None and t.layout == torch.strided and suggest_memory_format(t) == fmt


def is_channels_last(t: Tensor) -> bool:
    """channels_last (3-d convs: channels_last_3d), or its 1-d analogue (N, C, L) with strides
    (L·C, 1, C): "NLC"."""
    if t.dim() == 3:
        return t.stride(1) == 1 and t.shape[1] > 1 and t.transpose(1, 2).is_contiguous()
    fmt = channels_last_format(t.dim())
    return fmt is not None and t.is_contiguous(memory_format=fmt)


def as_2d(stride, padding, dilation) -> tuple[list, list, list]:
    """A 1-d conv's parameters for the same conv in 2-d over inputs of height 1."""
    return [1, *stride], [0, *padding], [1, *dilation]


def _mkldnn_ok(x: Tensor, weight: Tensor) -> bool:
    """oneDNN's fused conv: a 1-d to 3-d conv's CPU input, float32 (or bf16 where the CPU has it)."""
    if x.device.type != "cpu" or x.dim() not in (3, 4, 5) or not torch.backends.mkldnn.is_available():
        return False
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return True
    return x.dtype == weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def _aten_conv(x, weight, bias, other, stride, padding, dilation, groups, act):
    """The reference (unfused) computation, also the fallback where no fused kernel applies."""
    if weight.is_mkldnn:
        weight = weight.to_dense()
    y = torch.ops.aten.convolution.default(x, weight, bias, list(stride), list(padding), list(dilation),
                                           False, [0] * (x.dim() - 2), groups)
    if other is not None:
        y = torch.ops.aten.add.Tensor(y, other)
    name, scalars = onednn_unary(act)
    return UNARY[name](y, *scalars) if name in UNARY else y


def _cpu_conv(x, weight, bias, other, stride, padding, dilation, groups, act):
    if not _mkldnn_ok(x, weight):
        return _aten_conv(x, weight, bias, other, stride, padding, dilation, groups, act)
    if x.dim() == 3:
        # a 1-d conv runs as a 2-d one of height 1: oneDNN's add post-op is 2-d/3-d only, and
        # its 2-d kernels are faster than its 1-d ones (in channels_last most of all). A prepacked
        # (2-d) weight takes channels_last inputs.
        x4 = x.unsqueeze(2)
        if weight.is_mkldnn:
            x4 = x4.contiguous(memory_format=torch.channels_last)
        out = _cpu_conv(x4, weight if weight.is_mkldnn else weight.unsqueeze(2), bias,
                        None if other is None else other.unsqueeze(2), *as_2d(stride, padding, dilation),
                        groups, act)
        return out.squeeze(2)
    # private oneDNN entry points (the ones inductor's CPU fusion emits), isolated here
    try:
        if other is None:
            name, scalars = onednn_unary(act)
            return torch.ops.mkldnn._convolution_pointwise.default(
                x, weight, bias, list(padding), list(stride), list(dilation), groups, name, scalars, "")
        unary = None if act == "none" else act
        return torch.ops.mkldnn._convolution_pointwise.binary(
            x, other, weight, bias, list(padding), list(stride), list(dilation), groups, "add", None, unary,
            [], None)
    except RuntimeError:
        # oneDNN rejects some layouts ("could not create a memory" on torch 2.11 for a
        # channels_last 1x1-spatial residual): the same values, unfused
        return _aten_conv(x, weight, bias, other, stride, padding, dilation, groups, act)


def _cuda_conv(x, weight, bias, other, stride, padding, dilation, groups, act):
    cudnn_ok = (act == "relu" and torch.backends.cudnn.is_available() and torch.backends.cudnn.enabled
                and x.dim() == 4 and x.dtype in (torch.float32, torch.float16, torch.bfloat16)
                and x.dtype == weight.dtype and (other is None or other.dtype == x.dtype))
    if cudnn_ok:
        try:
            if other is None:
                return torch.cudnn_convolution_relu(x, weight, bias, list(stride), list(padding), list(dilation),
                                                    groups)
            return torch.cudnn_convolution_add_relu(x, weight, other, 1.0, bias, list(stride), list(padding),
                                                    list(dilation), groups)
        except RuntimeError:  # a configuration cuDNN's fused engine rejects: same values, unfused
            pass
    return _aten_conv(x, weight, bias, other, stride, padding, dilation, groups, act)


def _fused_conv(x, weight, bias, other, stride, padding, dilation, groups, act):
    _check_act(act)
    run = _cuda_conv if x.device.type == "cuda" else _cpu_conv
    return run(x, weight, bias, other, stride, padding, dilation, groups, act)


def conv_output_shape(x_shape: Sequence[int], weight_shape: Sequence[int], stride, padding, dilation) -> list[int]:
    spatial = [(size + 2 * p - d * (k - 1) - 1) // s + 1
               for size, k, s, p, d in zip(x_shape[2:], weight_shape[2:], stride, padding, dilation)]
    return [x_shape[0], weight_shape[0], *spatial]


def _fake_output(x: Tensor, weight: Tensor, stride, padding, dilation, packed: bool = False) -> Tensor:
    """Shape of the conv; channels_last when the weight is prepacked or the input or the weight
    suggests channels_last, as oneDNN's and cuDNN's kernels choose."""
    out = x.new_empty(conv_output_shape(x.shape, weight.shape, stride, padding, dilation))
    if out.dim() == 3:  # run in 2-d over height 1 (_cpu_conv): channels_last there is NLC here
        out4 = _fake_output(x.unsqueeze(2), weight.unsqueeze(2), *as_2d(stride, padding, dilation), packed)
        return out.as_strided(out.shape, [out4.stride(0), out4.stride(1), out4.stride(3)])
    if packed or _suggests_channels_last(x) or _suggests_channels_last(weight):
        out = out.contiguous(memory_format=channels_last_format(out.dim()))
    return out


# --- trainable ops -------------------------------------------------------------------------
@torch.library.custom_op("fxdream::conv_bias_relu", mutates_args=())
def conv_bias_relu(x: Tensor, weight: Tensor, bias: Optional[Tensor], stride: list[int], padding: list[int],
                   dilation: list[int], groups: int) -> Tensor:
    """relu(conv(x, weight, bias)) (1-d to 3-d) in one oneDNN / cuDNN call."""
    return _fused_conv(x, weight, bias, None, stride, padding, dilation, groups, "relu")


@torch.library.custom_op("fxdream::conv_bias_add_relu", mutates_args=())
def conv_bias_add_relu(x: Tensor, weight: Tensor, bias: Optional[Tensor], other: Tensor, stride: list[int],
                       padding: list[int], dilation: list[int], groups: int) -> Tensor:
    """relu(conv(x, weight, bias) + other) in one oneDNN / cuDNN call."""
    return _fused_conv(x, weight, bias, other, stride, padding, dilation, groups, "relu")


@conv_bias_relu.register_fake
def _(x, weight, bias, stride, padding, dilation, groups):
    return _fake_output(x, weight, stride, padding, dilation)


@conv_bias_add_relu.register_fake
def _(x, weight, bias, other, stride, padding, dilation, groups):
    return _fake_output(x, weight, stride, padding, dilation)


def _save(ctx, x, weight, bias, output, stride, padding, dilation, groups):
    ctx.save_for_backward(x, weight, output)
    ctx.bias_sizes = None if bias is None else [weight.shape[0]]
    ctx.conv_args = (list(stride), list(padding), list(dilation), groups)


def _conv_relu_grads(ctx, grad):
    """(grad through the ReLU, dx, dw, db): one convolution_backward for all three."""
    x, weight, output = ctx.saved_tensors
    stride, padding, dilation, groups = ctx.conv_args
    masked = torch.ops.aten.threshold_backward.default(grad, output, 0)
    need_x, need_w, need_b = ctx.needs_input_grad[:3]
    dx, dw, db = torch.ops.aten.convolution_backward.default(
        masked, x, weight, ctx.bias_sizes, stride, padding, dilation, False, [0] * (x.dim() - 2), groups,
        [need_x, need_w, need_b and ctx.bias_sizes is not None])
    return masked, dx, dw, db


def _setup_relu(ctx, inputs, output):
    x, weight, bias, stride, padding, dilation, groups = inputs
    _save(ctx, x, weight, bias, output, stride, padding, dilation, groups)


def _setup_add_relu(ctx, inputs, output):
    x, weight, bias, _other, stride, padding, dilation, groups = inputs
    _save(ctx, x, weight, bias, output, stride, padding, dilation, groups)


def _backward_relu(ctx, grad):
    _, dx, dw, db = _conv_relu_grads(ctx, grad)
    return dx, dw, db, None, None, None, None


def _backward_add_relu(ctx, grad):
    masked, dx, dw, db = _conv_relu_grads(ctx, grad)
    d_other = masked if ctx.needs_input_grad[3] else None
    return dx, dw, db, d_other, None, None, None, None


conv_bias_relu.register_autograd(_backward_relu, setup_context=_setup_relu)
conv_bias_add_relu.register_autograd(_backward_add_relu, setup_context=_setup_add_relu)


# --- inference op (no autograd; the weight may be prepacked) -------------------------------
def _fused_conv_prepacked(x, weight, bias, other, stride, padding, dilation, groups, act):
    out = _fused_conv(x, weight, bias, other, stride, padding, dilation, groups, act)
    # oneDNN returns channels_last (1-d: NLC) for a packed weight; the fallback is made to agree
    if is_channels_last(out):
        return out
    if out.dim() == 3:
        return out.unsqueeze(2).contiguous(memory_format=torch.channels_last).squeeze(2)
    return out.contiguous(memory_format=channels_last_format(out.dim()))


_SCHEMA = ("(Tensor x, Tensor weight, Tensor? bias, Tensor? other, int[] stride, int[] padding, "
           "int[] dilation, int groups, str act) -> Tensor")
_LIB = torch.library.Library("fxdream", "FRAGMENT")
_LIB.define("conv_fused_inference" + _SCHEMA)
_LIB.define("conv_fused_inference.prepacked" + _SCHEMA)
for _key in ("CPU", "MkldnnCPU", "CUDA"):
    _LIB.impl("conv_fused_inference", _fused_conv, _key)
for _key in ("CPU", "MkldnnCPU"):
    _LIB.impl("conv_fused_inference.prepacked", _fused_conv_prepacked, _key)


@torch.library.register_fake("fxdream::conv_fused_inference", lib=_LIB)
def _(x, weight, bias, other, stride, padding, dilation, groups, act):
    return _fake_output(x, weight, stride, padding, dilation)


@torch.library.register_fake("fxdream::conv_fused_inference.prepacked", lib=_LIB)
def _(x, weight, bias, other, stride, padding, dilation, groups, act):
    return _fake_output(x, weight, stride, padding, dilation, packed=True)


conv_fused_inference = torch.ops.fxdream.conv_fused_inference.default
"""act(conv(x, weight, bias) [+ other]) (1-d to 3-d), act one of ``UNARY`` (oneDNN's names; "hardtanh:LO,HI")
or "none"; no gradient."""
conv_fused_inference_prepacked = torch.ops.fxdream.conv_fused_inference.prepacked
"""The same with a weight from ``prepack_conv_weight``; the output is always channels_last
(3-d convs: channels_last_3d; 1-d: NLC)."""
INFERENCE_OPS = (conv_fused_inference, conv_fused_inference_prepacked)


def prepack_conv_weight(weight: Tensor, stride, padding, dilation, groups: int, input_size) -> Tensor:
    """The weight reordered once into oneDNN's blocked layout for inputs of ``input_size``.

    What inductor's CPU freezing does (``mkldnn._reorder_convolution_weight``, private,
    isolated here). The result is an opaque MKLDNN tensor for ``conv_fused_inference_prepacked``
    (CPU only), whose outputs are channels_last (3-d convs: channels_last_3d). A 1-d conv's
    weight is packed for the 2-d conv of height 1 it runs as (its outputs: NLC). A symbolic
    size (dynamo's dynamic shapes) is read at its hint, without a guard: the packed weight
    serves inputs of any size, and an int() of it would fix the size for the whole graph.
    """
    weight, input_size = weight.detach(), [size_hint(s) for s in input_size]  # a symbolic batch stays symbolic
    if weight.dim() == 3:
        weight, input_size = weight.unsqueeze(2), [*input_size[:2], 1, input_size[2]]
        stride, padding, dilation = as_2d(stride, padding, dilation)
    return torch.ops.mkldnn._reorder_convolution_weight(
        weight, list(padding), list(stride), list(dilation), groups, input_size)


def can_prepack(x: Tensor, weight: Tensor) -> bool:
    return _mkldnn_ok(x, weight)


@register_flop_formula([torch.ops.fxdream.conv_bias_relu, torch.ops.fxdream.conv_bias_add_relu,
                        torch.ops.fxdream.conv_fused_inference])
def _fused_conv_flops(x_shape, w_shape, *_, out_shape=None, **__) -> int:
    """A fused conv does the convolution's FLOPs (the bias, add and ReLU are memory traffic):
    without this the analytic cost model saw 0 FLOPs and predicted fused convs as free."""
    return conv_flop_count(x_shape, w_shape, out_shape)


@register_flop_formula([torch.ops.mkldnn._convolution_pointwise, torch.ops.mkldnn._convolution_pointwise_])
def _onednn_conv_flops(a, b, c, *_, out_shape=None, **__) -> int:
    """(X, W, B, ...), (X, other, W, ...) or, in place, (other, X, W, ...): the weight is the
    third argument when that has the input's rank. conv_flop_count reads only the batch from the
    input, which ``other`` (the output's shape) has too."""
    if c is not None and len(c) == len(a):
        return conv_flop_count(a, c, out_shape)
    return conv_flop_count(a, b, out_shape)


def optional_op(namespace: str, name: str):
    """``torch.ops.<namespace>.<name>`` (an overload packet), or None where this build lacks it
    (MKL's ops are not in builds without MKL, e.g. on ARM)."""
    try:
        return getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return None


ONEDNN_LINEAR = optional_op("mkldnn", "_linear_pointwise")
MKL_LINEAR = optional_op("mkl", "_mkl_linear")


def _linear_flops(x_shape, w_shape) -> int:
    """2·rows·in·out, as addmm's (a post-op is memory traffic)."""
    rows = 1
    for size in x_shape[:-1]:
        rows *= size
    return 2 * rows * x_shape[-1] * w_shape[0]


if ONEDNN_LINEAR is not None:
    @register_flop_formula(ONEDNN_LINEAR)
    def _onednn_linear_flops(x_shape, w_shape, *_, out_shape=None, **__) -> int:
        """prepack_linear's oneDNN op (x, packed w, bias, post-op...)."""
        return _linear_flops(x_shape, w_shape)

if MKL_LINEAR is not None:
    @register_flop_formula(MKL_LINEAR)
    def _mkl_linear_flops(x_shape, _packed_shape, w_shape, *_, out_shape=None, **__) -> int:
        """prepack_linear's MKL op (x, packed, w, bias, rows): the packed buffer's shape is opaque."""
        return _linear_flops(x_shape, w_shape)


# --- the ops a rewritten graph may hold (onednn_direct puts the oneDNN ones in) -----------
ONEDNN_CONV = torch.ops.mkldnn._convolution_pointwise.default
ONEDNN_CONV_ADD_ = torch.ops.mkldnn._convolution_pointwise_.binary  # accumulates into ``other``
FUSED_OPS = (torch.ops.fxdream.conv_bias_relu.default, torch.ops.fxdream.conv_bias_add_relu.default,
             conv_fused_inference, conv_fused_inference_prepacked, ONEDNN_CONV, ONEDNN_CONV_ADD_)
