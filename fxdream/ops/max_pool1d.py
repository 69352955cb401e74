"""1-d max pooling (``F.max_pool1d``, ``nn.MaxPool1d``) as one op in inference graphs.

On a CPU tensor without grad, eager's ``torch.max_pool1d`` runs a dedicated kernel; for
anything else (a tensor needing grad, a GPU tensor, or the wrapped tensors a trace runs on)
it computes ``max_pool2d_with_indices`` over height 1 and drops the indices. So a capture
would get that path, many times slower than eager's kernel.
``max_pool1d_inference`` calls ``torch.max_pool1d`` at run time (eager's kernel, values
bit-identical), one node for the cost model. Inference only, as ``upsample_op``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from fxdream.ir.call_args import bind
from fxdream.ops.autocast import autocast_on

_LIB = torch.library.Library("fxdream", "FRAGMENT")
_LIB.define("max_pool1d_inference(Tensor input, int kernel_size, int stride, int padding, int dilation, "
            "bool ceil_mode) -> Tensor")


def _max_pool1d(input, kernel_size, stride, padding, dilation, ceil_mode):
    return torch.max_pool1d(input, [kernel_size], [stride], [padding], [dilation], ceil_mode)


for _key in ("CPU", "CUDA"):
    _LIB.impl("max_pool1d_inference", _max_pool1d, _key)


@torch.library.register_fake("fxdream::max_pool1d_inference", lib=_LIB)
def _(input, kernel_size, stride, padding, dilation, ceil_mode):
    # ATen's pooling_output_shape; the kernels return a new contiguous tensor
    span = input.shape[-1] + 2 * padding - dilation * (kernel_size - 1) - 1 + (stride - 1 if ceil_mode else 0)
    length = span // stride + 1
    if ceil_mode and (length - 1) * stride >= input.shape[-1] + padding:
        length -= 1
    return input.new_empty((*input.shape[:-1], length))


max_pool1d_inference = torch.ops.fxdream.max_pool1d_inference.default
FUNCTIONS = (F.max_pool1d, torch.max_pool1d)
_NAMES = ("input", "kernel_size", "stride", "padding", "dilation", "ceil_mode", "return_indices")
_DEFAULTS = (None, None, None, 0, 1, False, False)


def redirect_max_pool1d(args, kwargs):
    """``max_pool1d_inference(...)`` for a max_pool1d call without indices on a tensor of
    static shape; else None (the call is traced as it is)."""
    values = bind(args, kwargs, _NAMES, _DEFAULTS)
    if values is None:
        return None
    input = values["input"]
    if values["return_indices"] or not isinstance(input, torch.Tensor) or input.dim() not in (2, 3) \
            or not all(isinstance(s, int) for s in input.shape):
        return None
    ints = []
    for name in ("kernel_size", "stride", "padding", "dilation"):
        value = values[name]
        if name == "stride" and value in (None, [], ()):
            value = values["kernel_size"]
        value = value[0] if isinstance(value, (list, tuple)) and len(value) == 1 else value
        if not isinstance(value, int) or isinstance(value, bool):
            return None
        ints.append(value)
    if not isinstance(values["ceil_mode"], bool) or autocast_on(input.device):
        return None
    return max_pool1d_inference(input, *ints, values["ceil_mode"])
