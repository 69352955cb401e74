"""``F.scaled_dot_product_attention`` as one op in inference graphs on a GPU, and as the fused
kernel on the meta device (``fused_on_meta``).

aot_autograd traces SDPA through its CompositeImplicit definition and, under fake tensors,
picks the backend then, not as eager picks it at run time: for Hugging Face's BertModel in
fp16 on a GPU it picks the math path, which upcasts to fp32 (4 copies and two fp32 GEMMs per
layer), where eager runs cuDNN's fused attention.
``attention_inference`` is an opaque op that calls the same function at run time, so the
backend is chosen as eager chooses it. Inference only (no autograd formula); a CPU capture
keeps its fused ``_scaled_dot_product_flash_attention_for_cpu`` and needs none of this.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from fxdream.ir.call_args import bind
from fxdream.ops.autocast import autocast_on

_LIB = torch.library.Library("fxdream", "FRAGMENT")
_LIB.define("attention_inference(Tensor query, Tensor key, Tensor value, Tensor? attn_mask, float dropout_p, "
            "bool is_causal, float? scale) -> Tensor")


# Captured into a CUDA graph, cuDNN's attention can keep a pointer to host memory that is gone
# by a later replay (pytorch/pytorch #169849: an illegal memory access, inside torch.compile's
# own CUDA graphs too). While a stream captures, this op leaves cuDNN's backend out.
_CAPTURE_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _attention(query, key, value, attn_mask, dropout_p, is_causal, scale):
    # contiguous: the fused kernels' output layout follows q's and varies by backend; the fake
    # op below promises a contiguous tensor, so the real one must be one
    call = lambda: F.scaled_dot_product_attention(  # noqa: E731
        query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale).contiguous()
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        with sdpa_kernel(_CAPTURE_BACKENDS):
            return call()
    return call()


for _key in ("CPU", "CUDA"):
    _LIB.impl("attention_inference", _attention, _key)


@torch.library.register_fake("fxdream::attention_inference", lib=_LIB)
def _(query, key, value, attn_mask, dropout_p, is_causal, scale):
    return query.new_empty((*query.shape[:-1], value.shape[-1]))


attention_inference = torch.ops.fxdream.attention_inference.default
_NAMES = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")
_DEFAULTS = (None, None, None, None, 0.0, False, None)


def redirect_attention(args, kwargs, devices=("cuda",)):
    """For an SDPA call that uses no argument the ops lack (such as ``enable_gqa``), outside
    autocast: on the meta device, the fused kernel (``fused_on_meta``), in inference and training;
    in inference on one of ``devices``, ``attention_inference(...)``; else None."""
    values = bind(args, kwargs, _NAMES, _DEFAULTS)
    if values is None:
        return None
    query = values["query"]
    if not isinstance(query, torch.Tensor) or autocast_on(query.device):  # autocast casts SDPA's inputs above us
        return None
    if query.device.type == "meta":
        return fused_on_meta(values)
    needs_grad = any(isinstance(t, torch.Tensor) and t.requires_grad for t in (query, values["key"], values["value"]))
    if query.device.type not in devices or needs_grad:  # the op has no gradient formula
        return None
    return attention_inference(*(values[n] for n in _NAMES))


def fused_on_meta(values: dict) -> torch.Tensor | None:
    """SDPA on meta tensors as the memory-efficient fused kernel a GPU runs (for fp32 inputs or a
    mask; flash attention, taken for half precision without a mask, has the same FLOPs and O(n)
    memory), with its gradient formula. torch registers no backend choice for the meta device, so
    the SDPA it traces there is the math fallback: the whole attention matrix materialized (and in
    training saved), which no GPU or CPU capture has. None (traced as it is) for other than
    4-d query, key and value."""
    query, key, value, mask = (values[n] for n in ("query", "key", "value", "attn_mask"))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (query, key, value)):
        return None
    if isinstance(mask, torch.Tensor) and mask.dtype == torch.bool:  # as SDPA converts it: an additive bias
        mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(~mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, mask, torch.is_grad_enabled() and query.requires_grad, values["dropout_p"],
        values["is_causal"], scale=values["scale"])[0]


@contextlib.contextmanager
def meta_attention_redirected():
    """While ``F.multi_head_attention_forward`` runs inside the tracing mode's own handler (where
    the mode is off, so it cannot see the SDPA call it makes): SDPA on meta tensors is the fused
    kernel (``fused_on_meta``). The function looks ``scaled_dot_product_attention`` up in its
    module at each call; a call from another thread meanwhile gets the same values."""
    original = F.scaled_dot_product_attention

    def call(*args, **kwargs):
        fused = redirect_attention(args, kwargs, devices=())  # on the meta device only
        return fused if fused is not None else original(*args, **kwargs)
    with mock.patch.object(F, "scaled_dot_product_attention", call):
        yield
