"""GRU and vanilla-RNN layers as one op in inference graphs.

aot_autograd traces ``torch._VF.gru`` (what ``nn.GRU.forward`` calls) through its
CompositeImplicit definition: on CPU, where there is no fused kernel, that is a handful of
ATen ops per time step and layer (a 32-step bidirectional GRU: ~1500 nodes), and running
them from Python took 3.5x eager's C++ loop (measured here, batch 8). ``nn.LSTM`` does not
need this: on CPU it lowers to oneDNN's fused ``mkldnn_rnn_layer``, on CUDA to cuDNN's; except
with projections (``proj_size``) on a CPU, which oneDNN does not take: ``lstm_inference``.

``keep_ops_whole()`` is active while a capture traces a graph; in inference it sends those
calls to ``fxdream::rnn_inference``, an opaque op that calls the same ``torch._VF`` function
(so values are bit-identical to eager) and that the cost model times as one node.
Inference only: no autograd formula (training keeps dynamo's graph break at the RNN).
``keep_ops_whole`` keeps RNN cells (``rnn_cell_op``), upsampling (``upsample_op``), circular
padding (``pad_op``), 1-d max pooling (``max_pool1d_op``) and, on a GPU, SDPA (``sdpa_op``) whole
the same way.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .max_pool1d_op import FUNCTIONS as MAX_POOL1D_FUNCTIONS, redirect_max_pool1d
from .pad_op import FUNCTIONS as PAD_FUNCTIONS, redirect_pad
from .rnn_cell_op import FUNCTIONS as CELL_FUNCTIONS, redirect_rnn_cell
from .sdpa_op import redirect_attention
from .upsample_op import FUNCTIONS as UPSAMPLE_FUNCTIONS, redirect_upsample, upsample_calls_redirected

_FUNCTIONS = {"gru": torch._VF.gru, "rnn_tanh": torch._VF.rnn_tanh, "rnn_relu": torch._VF.rnn_relu}

_LIB = torch.library.Library("fxdream", "FRAGMENT")
_LIB.define("rnn_inference(Tensor input, Tensor hx, Tensor[] params, str mode, bool has_biases, "
            "int num_layers, bool bidirectional, bool batch_first) -> (Tensor, Tensor)")


def _rnn_inference(input, hx, params, mode, has_biases, num_layers, bidirectional, batch_first):
    return _FUNCTIONS[mode](input, hx, params, has_biases, num_layers, 0.0, False, bidirectional, batch_first)


for _key in ("CPU", "CUDA"):
    _LIB.impl("rnn_inference", _rnn_inference, _key)


@torch.library.register_fake("fxdream::rnn_inference", lib=_LIB)
def _(input, hx, params, mode, has_biases, num_layers, bidirectional, batch_first):
    # output: the input's shape with features = directions × hidden, and eager's strides: the
    # kernels run time-major, so a batch_first output is a (batch, time) view of a (time, batch)
    # tensor (claimed contiguous, a later view of it traced fine and failed on the real one)
    features = (2 if bidirectional else 1) * hx.shape[-1]
    if batch_first:
        output = input.new_empty((input.shape[1], input.shape[0], features)).transpose(0, 1)
    else:
        output = input.new_empty((*input.shape[:-1], features))
    return output, hx.new_empty(hx.shape)


rnn_inference = torch.ops.fxdream.rnn_inference.default

# An LSTM with projections (``proj_size``): oneDNN's fused layer does not take them, so on a CPU
# eager runs ATen's C++ loop, which a trace unrolls into ops per time step (256 wide, 50 steps:
# 1218 nodes, 1.7x eager's time). Without projections the capture keeps oneDNN's layer.
_LIB.define("lstm_inference(Tensor input, Tensor[] hx, Tensor[] params, bool has_biases, int num_layers, "
            "bool bidirectional, bool batch_first) -> (Tensor, Tensor, Tensor)")


def _lstm_inference(input, hx, params, has_biases, num_layers, bidirectional, batch_first):
    return torch._VF.lstm(input, tuple(hx), params, has_biases, num_layers, 0.0, False, bidirectional, batch_first)


for _key in ("CPU", "CUDA"):
    _LIB.impl("lstm_inference", _lstm_inference, _key)


@torch.library.register_fake("fxdream::lstm_inference", lib=_LIB)
def _(input, hx, params, has_biases, num_layers, bidirectional, batch_first):
    features = (2 if bidirectional else 1) * hx[0].shape[-1]  # the projected size
    if batch_first:  # time-major underneath, as rnn_inference's
        output = input.new_empty((input.shape[1], input.shape[0], features)).transpose(0, 1)
    else:
        output = input.new_empty((*input.shape[:-1], features))
    return output, hx[0].new_empty(hx[0].shape), hx[1].new_empty(hx[1].shape)


lstm_inference = torch.ops.fxdream.lstm_inference.default


def _redirect_lstm(args, kwargs):
    """``lstm_inference(...)`` for a CPU inference LSTM with projections (as nn.LSTM calls
    ``_VF.lstm``: 9 arguments, train=False); else None."""
    if kwargs or len(args) != 9 or args[6] is not False or not isinstance(args[1], (tuple, list)):
        return None
    input, (h, c), params, has_biases, num_layers, _dropout, _train, bidirectional, batch_first = args
    if not all(isinstance(t, torch.Tensor) for t in (input, h, c)) or input.device.type != "cpu" \
            or h.shape[-1] == c.shape[-1] or torch.is_autocast_enabled("cpu"):
        return None
    return tuple(lstm_inference(input, [h, c], list(params), has_biases, num_layers, bidirectional, batch_first))


def _redirect_rnn(mode, args, kwargs):
    """``rnn_inference(...)`` for the input-tensor overload of GRU/RNN as nn.GRU / nn.RNN call
    it (9 arguments, train=False), outside autocast (it casts the RNN's inputs); else None."""
    if kwargs or len(args) != 9 or args[6] is not False \
            or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], torch.Tensor) \
            or torch.is_autocast_enabled(args[0].device.type):
        return None
    input, hx, params, has_biases, num_layers, _dropout, _train, bidirectional, batch_first = args
    return tuple(rnn_inference(input, hx, list(params), mode, has_biases, num_layers, bidirectional, batch_first))


# torch function → (args, kwargs) → the whole op's call, or None to trace the call as it is
_REDIRECTS = {**{f: functools.partial(_redirect_rnn, mode) for mode, f in _FUNCTIONS.items()},
              **{f: functools.partial(redirect_upsample, f) for f in UPSAMPLE_FUNCTIONS},
              **{f: redirect_pad for f in PAD_FUNCTIONS},
              **{f: redirect_max_pool1d for f in MAX_POOL1D_FUNCTIONS},
              **{f: functools.partial(redirect_rnn_cell, f) for f in CELL_FUNCTIONS},
              torch._VF.lstm: _redirect_lstm,
              F.scaled_dot_product_attention: redirect_attention}
_DIFFERENTIABLE = frozenset({F.interpolate, *UPSAMPLE_FUNCTIONS})  # whole ops with a gradient formula


class _KeepOpsWhole(TorchFunctionMode):
    """Redirects (``_REDIRECTS``) GRU/RNN layers to ``rnn_inference``, a CPU LSTM with
    projections to ``lstm_inference``, RNN cells, upsampling, circular padding and 1-d max
    pooling to their ops (rnn_cell_op, upsample_op, pad_op, max_pool1d_op), and on a GPU SDPA
    to ``fxdream::attention_inference`` (sdpa_op). While a training graph is traced, only what
    has a gradient formula: upsampling."""

    def __init__(self, training: bool = False):
        super().__init__()
        self.training = training

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.training and func not in _DIFFERENTIABLE:
            return func(*args, **(kwargs or {}))
        if func is F.interpolate:  # what it calls is redirected below
            with upsample_calls_redirected():
                return func(*args, **(kwargs or {}))
        redirect = _REDIRECTS.get(func)
        if redirect is not None:
            kept = redirect(args, kwargs or {})
            if kept is not None:
                return kept
        return func(*args, **(kwargs or {}))


def keep_ops_whole(gm: torch.fx.GraphModule | None = None):
    """While tracing a graph: in inference GRU/RNN layers (and a CPU LSTM with projections),
    RNN cells, upsampling, circular padding and 1-d max pooling become one node each (and SDPA
    on a GPU one ``attention_inference``); in training upsampling only. Given the graph about to
    be traced, only if it may call one: the mode's Python hook on every torch call made
    ResNet-50's capture ~9 % slower (0.93 vs 0.85 s, medians of 4, interleaved)."""
    training = torch.is_grad_enabled()
    if gm is not None and not may_call_whole_ops(gm, training):
        return contextlib.nullcontext()
    return _KeepOpsWhole(training)


_WHOLE_FUNCTIONS = (F.interpolate, *_REDIRECTS)
# torch.nn modules a graph may call as leaves (torch.fx's default) that call one of those inside
_WHOLE_MODULES = (torch.nn.RNNBase, torch.nn.RNNCellBase, torch.nn.Upsample, torch.nn.MaxPool1d,
                  torch.nn.modules.padding._CircularPadNd, torch.nn.MultiheadAttention,
                  torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer, torch.nn.TransformerEncoder,
                  torch.nn.TransformerDecoder, torch.nn.Transformer)


def may_call_whole_ops(gm: torch.fx.GraphModule, training: bool = False) -> bool:
    """Whether ``gm`` calls a function kept whole (in ``training``, one with a gradient formula),
    directly or in a leaf module; True when unsure (a call into Python code that is not a torch op)."""
    functions, modules = (_DIFFERENTIABLE, torch.nn.Upsample) if training else (_WHOLE_FUNCTIONS, _WHOLE_MODULES)
    for node in gm.graph.nodes:
        if node.op == "call_function" and (node.target in functions or not _is_torch_callable(node.target)):
            return True
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            if any(isinstance(m, modules) or (not training and getattr(m, "padding_mode", None) == "circular")
                   for m in module.modules()) or type(module).__module__.split(".")[0] != "torch":
                return True
    return False


def _is_torch_callable(target) -> bool:
    if isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return True
    module = getattr(target, "__module__", None) or ""
    return module.split(".")[0] in ("torch", "_operator", "operator", "builtins", "math")


@contextlib.contextmanager
def outside_keep_ops_whole():
    """For aot's compiler callbacks (passes, in-context profiling): without the mode, whose
    Python hook on every torch call (~10-40 µs here) the profile would count as op time."""
    if isinstance(torch.overrides._get_current_function_mode(), _KeepOpsWhole):  # private, isolated
        with torch.overrides._pop_mode_temporarily():
            yield
    else:
        yield
