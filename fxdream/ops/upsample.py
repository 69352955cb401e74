"""Upsampling (``F.interpolate``, ``nn.Upsample``) as one op in captured graphs.

aot_autograd traces ``torch._C._nn.upsample_bilinear2d`` and its kin through the Python
decompositions torch registers for them (index arithmetic, ``_unsafe_index`` gathers and
lerps: ~35 ATen ops for one bilinear upsample, ~150 for a bicubic one), which only a code
generator such as inductor can fuse back. Run op by op they are several times slower than
eager's one kernel, enough to make a U-Net's capture slower than eager.

``upsample`` is an opaque op that calls the same ``torch._C._nn`` function at run
time (values bit-identical to eager) and that the cost model times as one node. Its gradient
is the ATen backward kernel eager's autograd runs (``upsample_bilinear2d_backward`` ...), so a
training capture keeps it whole too: with the decomposition's forward and backward, a U-Net's
captured training step is slower than eager's.
"""
from __future__ import annotations

import contextlib
from unittest import mock

import torch

from fxdream.ops.autocast import autocast_on

_LIB = torch.library.Library("fxdream", "FRAGMENT")
_LIB.define("upsample(Tensor input, str name, int[]? output_size, bool? align_corners, "
            "float[]? scale_factors) -> Tensor")

# what F.interpolate calls (the ``.vec`` overloads: output size or scale factors)
_NEAREST = ("upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d",
            "_upsample_nearest_exact1d", "_upsample_nearest_exact2d", "_upsample_nearest_exact3d")
_WITH_ALIGN_CORNERS = ("upsample_linear1d", "upsample_bilinear2d", "upsample_trilinear3d", "upsample_bicubic2d",
                       "_upsample_bilinear2d_aa", "_upsample_bicubic2d_aa")
FUNCTIONS = {getattr(torch._C._nn, name): name for name in _NEAREST + _WITH_ALIGN_CORNERS
             if hasattr(torch._C._nn, name)}
_BY_NAME = {name: function for function, name in FUNCTIONS.items()}  # never the redirecting stand-ins


def _upsample(input, name, output_size, align_corners, scale_factors):
    function = _BY_NAME[name]
    if name in _NEAREST:
        return function(input, output_size, scale_factors)
    return function(input, output_size, align_corners, scale_factors)


for _key in ("CPU", "CUDA"):
    _LIB.impl("upsample", _upsample, _key)


def _output_size(input_shape, output_size, scale_factors) -> list[int]:
    """As at::upsample_compute_output_size: a double product, truncated."""
    if output_size is not None:
        return list(output_size)
    return [torch.sym_int(size * scale) for size, scale in zip(input_shape[2:], scale_factors)]


@torch.library.register_fake("fxdream::upsample", lib=_LIB)
def _(input, name, output_size, align_corners, scale_factors):
    # laid out as the input suggests (channels_last in, channels_last out), as the kernels do
    return torch.empty((*input.shape[:2], *_output_size(input.shape, output_size, scale_factors)),
                       dtype=input.dtype, device=input.device, memory_format=_suggested_format(input))


def _setup_context(ctx, inputs, output):
    input, ctx.name, ctx.output_size, ctx.align_corners, ctx.scale_factors = inputs
    ctx.input_shape = list(input.shape)


def _backward(ctx, grad):
    """What eager's autograd runs: ``aten.<name>_backward`` with the output size and the scale
    factors the ``.vec`` overload hands its ``.default`` one (None where a size was given)."""
    backward = getattr(torch.ops.aten, f"{ctx.name}_backward").default
    size = _output_size(ctx.input_shape, ctx.output_size, ctx.scale_factors)
    scales = list(ctx.scale_factors) if ctx.scale_factors is not None else [None] * len(size)
    corners = () if ctx.name in _NEAREST else (ctx.align_corners,)
    return backward(grad, size, ctx.input_shape, *corners, *scales), None, None, None, None


torch.library.register_autograd("fxdream::upsample", _backward, setup_context=_setup_context, lib=_LIB)


def _suggested_format(x: torch.Tensor) -> torch.memory_format:
    try:
        from torch._prims_common import suggest_memory_format  # Tensor.suggest_memory_format in Python
    except ImportError:  # older torch: the same test, for the common cases
        channels_last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
        if channels_last is not None and not x.is_contiguous() and x.is_contiguous(memory_format=channels_last):
            return channels_last
        return torch.contiguous_format
    return suggest_memory_format(x)


upsample = torch.ops.fxdream.upsample.default


def redirect_upsample(function, args, kwargs):
    """``upsample(...)`` for a call of one of ``FUNCTIONS`` in the form F.interpolate
    uses, on a tensor of static shape; else None (the call is traced as it is)."""
    name = FUNCTIONS.get(function)
    count = 3 if name in _NEAREST else 4
    if name is None or kwargs or len(args) != count:
        return None
    input, output_size, scale_factors = args[0], args[1], args[-1]
    align_corners = None if name in _NEAREST else args[2]
    if not isinstance(input, torch.Tensor) or input.dim() < 3 \
            or not all(isinstance(s, int) for s in input.shape):  # symbolic sizes: leave to torch
        return None
    if (output_size is None) == (scale_factors is None):
        return None
    if output_size is not None and not all(isinstance(s, int) for s in output_size):
        return None
    if name not in _NEAREST and not isinstance(align_corners, bool):
        return None
    if autocast_on(input.device):  # autocast casts the op's input above us
        return None
    return upsample(input, name, None if output_size is None else list(output_size), align_corners,
                    None if scale_factors is None else [float(s) for s in scale_factors])


@contextlib.contextmanager
def upsample_calls_redirected():
    """While ``F.interpolate`` runs inside the tracing mode's own handler (where the mode is off,
    so it cannot see the ``torch._C._nn`` call F.interpolate makes): those functions redirect.
    F.interpolate looks them up at each call; a call from another thread meanwhile would get
    the op too, whose values are the same."""
    def redirecting(original):
        def call(*args, **kwargs):
            kept = redirect_upsample(original, args, kwargs)
            return kept if kept is not None else original(*args, **kwargs)
        return call
    with mock.patch.multiple(torch._C._nn, **{name: redirecting(original) for name, original in _BY_NAME.items()}):
        yield
