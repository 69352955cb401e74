"""``F.scaled_dot_product_attention`` as one op in inference graphs on a GPU.

aot_autograd traces SDPA through its CompositeImplicit definition and, under fake tensors,
picks the backend then, not as eager picks it at run time: for Hugging Face's BertModel in
fp16 on a GPU it picks the math path, which upcasts to fp32 (4 copies and two fp32 GEMMs per
layer), where eager runs cuDNN's fused attention.
``attention_inference`` is an opaque op that calls the same function at run time, so the
backend is chosen as eager chooses it. Inference only (no autograd formula); a CPU capture
keeps its fused ``_scaled_dot_product_flash_attention_for_cpu`` and needs none of this.
"""
from __future__ import annotations

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
    """``attention_inference(...)`` for an SDPA call whose query is on one of ``devices``
    (and that uses no argument the op lacks, such as ``enable_gqa``, outside autocast); else None."""
    values = bind(args, kwargs, _NAMES, _DEFAULTS)
    if values is None:
        return None
    query = values["query"]
    if not isinstance(query, torch.Tensor) or query.device.type not in devices:
        return None
    if autocast_on(query.device):  # autocast would cast SDPA's inputs; the op sits below it
        return None
    return attention_inference(*(values[n] for n in _NAMES))
