"""Circular padding (``F.pad(mode="circular")``, ``padding_mode="circular"`` convs) as one op
in inference graphs.

Eager pads circularly in one C++ call that copies the input's edges into a new tensor. aot_autograd
functionalizes those copies into slices and ``slice_scatter`` ops (25 ATen ops for a 2-d pad),
each scatter a copy of the whole output: many times eager's time, enough to make a conv with
circular padding slower captured than eager. ``pad_inference``
calls the same function at run time (values bit-identical), one node for the cost model.
Inference only, as ``upsample_op``; the other padding modes are one ATen op already.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fxdream.ir.call_args import bind
from fxdream.ops.autocast import autocast_on

_LIB = torch.library.Library("fxdream", "FRAGMENT")
_LIB.define("pad_inference(Tensor input, int[] pad, str mode) -> Tensor")


def _pad(input, pad, mode):
    return torch._C._nn.pad(input, pad, mode, None)


for _key in ("CPU", "CUDA"):
    _LIB.impl("pad_inference", _pad, _key)


@torch.library.register_fake("fxdream::pad_inference", lib=_LIB)
def _(input, pad, mode):
    # ``pad`` runs from the last dim backwards, (left, right) each; the output is a new,
    # contiguous tensor (at::_pad_circular allocates it with new_empty)
    shape = list(input.shape)
    for i in range(len(pad) // 2):
        shape[-1 - i] += pad[2 * i] + pad[2 * i + 1]
    return input.new_empty(shape)


pad_inference = torch.ops.fxdream.pad_inference.default
FUNCTIONS = (F.pad, torch._C._nn.pad)


def redirect_pad(args, kwargs):
    """``pad_inference(...)`` for a circular ``F.pad`` / ``torch._C._nn.pad`` call on a tensor
    of static shape; else None (the call is traced as it is)."""
    values = bind(args, kwargs, ("input", "pad", "mode", "value"), (None, None, "constant", None))
    if values is None:
        return None
    input, pad = values["input"], values["pad"]
    if values["mode"] != "circular" or values["value"] is not None or not isinstance(input, torch.Tensor):
        return None
    if not all(isinstance(s, int) for s in (*input.shape, *pad)):  # symbolic sizes: leave to torch
        return None
    if autocast_on(input.device):
        return None
    return pad_inference(input, list(pad), "circular")
