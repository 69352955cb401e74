"""GRU and vanilla-RNN layers as one op in inference graphs.

aot_autograd traces ``torch._VF.gru`` (what ``nn.GRU.forward`` calls) through its
CompositeImplicit definition: on CPU, where there is no fused kernel, that is a handful of
ATen ops per time step and layer (a 32-step bidirectional GRU: ~1500 nodes), and running
them from Python takes several times as long as eager's C++ loop. ``nn.LSTM`` on a CPU
lowers to oneDNN's fused ``mkldnn_rnn_layer``, except with projections (``proj_size``), which
oneDNN does not take: ``lstm_inference``. On a GPU the trace unrolls every LSTM into ops per
time step, where eager runs cuDNN's fused layer (GNMT fp16 bs1 on an H200: 4991 kernels, the
captured call 9x eager's time): ``lstm_inference`` there too.

``keep_ops_whole()`` is active while a capture traces a graph; in inference it sends those
calls to ``fxdream::rnn_inference``, an opaque op that calls the same ``torch._VF`` function
(so values are bit-identical to eager) and that the cost model times as one node.
Inference only: no autograd formula (training keeps dynamo's graph break at the RNN), except on
the meta device, where a prediction's capture computes nothing: there a training RNN is one op
with its backward (``lstm_train``, ``rnn_train``), as cuDNN and oneDNN run it.
``keep_ops_whole`` keeps RNN cells (``rnn_cell_op``), upsampling (``upsample_op``), circular
padding (``pad_op``), 1-d max pooling (``max_pool1d_op``) and, on a GPU, SDPA (``sdpa_op``) whole
the same way.
"""
from __future__ import annotations

import torch

from fxdream.ops.autocast import autocast_on

FUNCTIONS = {"gru": torch._VF.gru, "rnn_tanh": torch._VF.rnn_tanh, "rnn_relu": torch._VF.rnn_relu}

_LIB = torch.library.Library("fxdream", "FRAGMENT")
_LIB.define("rnn_inference(Tensor input, Tensor hx, Tensor[] params, str mode, bool has_biases, "
            "int num_layers, bool bidirectional, bool batch_first) -> (Tensor, Tensor)")


def _rnn_inference(input, hx, params, mode, has_biases, num_layers, bidirectional, batch_first):
    return FUNCTIONS[mode](input, hx, params, has_biases, num_layers, 0.0, False, bidirectional, batch_first)


for _key in ("CPU", "CUDA"):
    _LIB.impl("rnn_inference", _rnn_inference, _key)


@torch.library.register_fake("fxdream::rnn_inference", lib=_LIB)
def _(input, hx, params, mode, has_biases, num_layers, bidirectional, batch_first):
    # output: the input's shape with features = directions × hidden, and eager's strides: the
    # kernels run time-major, so a batch_first output is a (batch, time) view of a (time, batch)
    # tensor (claimed contiguous, a later view of it would trace fine and fail on the real one)
    features = (2 if bidirectional else 1) * hx.shape[-1]
    if batch_first:
        output = input.new_empty((input.shape[1], input.shape[0], features)).transpose(0, 1)
    else:
        output = input.new_empty((*input.shape[:-1], features))
    return output, hx.new_empty(hx.shape)


rnn_inference = torch.ops.fxdream.rnn_inference.default

# An LSTM with projections (``proj_size``): oneDNN's fused layer does not take them, so on a CPU
# eager runs ATen's C++ loop, which a trace unrolls into ops per time step (256 wide, 50 steps:
# 1218 nodes), slower than eager's loop. Without projections the capture keeps oneDNN's layer.
# On the meta device (a prediction's capture) ATen has neither oneDNN's nor cuDNN's layer and
# unrolls every LSTM the same way, where the devices predicted for run one fused layer: kept whole.
# On a GPU the trace unrolls it as well, where eager runs cuDNN's layer: kept whole, calling it.
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

# A stacked RNN module left in train mode inside an inference build (Monte Carlo dropout): torch's
# decomposition of a train-mode RNN drops the dropout between layers (``_rnn_helper``'s condition
# never holds), so a trace would run it without. Kept whole instead, calling the same ``torch._VF``
# function with ``train=True``: eager's dropout, drawn from the same generator as eager's. Tagged
# nondeterministic_seeded: two calls on the same inputs are two draws, never one.
_LIB.define("rnn_dropout(Tensor input, Tensor hx, Tensor[] params, str mode, bool has_biases, int num_layers, "
            "bool bidirectional, bool batch_first, float dropout) -> (Tensor, Tensor)",
            tags=(torch.Tag.nondeterministic_seeded,))
_LIB.define("lstm_dropout(Tensor input, Tensor[] hx, Tensor[] params, bool has_biases, int num_layers, "
            "bool bidirectional, bool batch_first, float dropout) -> (Tensor, Tensor, Tensor)",
            tags=(torch.Tag.nondeterministic_seeded,))


def _rnn_dropout(input, hx, params, mode, has_biases, num_layers, bidirectional, batch_first, dropout):
    return FUNCTIONS[mode](input, hx, params, has_biases, num_layers, dropout, True, bidirectional, batch_first)


def _lstm_dropout(input, hx, params, has_biases, num_layers, bidirectional, batch_first, dropout):
    return torch._VF.lstm(input, tuple(hx), params, has_biases, num_layers, dropout, True, bidirectional,
                          batch_first)


for _key in ("CPU", "CUDA"):
    _LIB.impl("rnn_dropout", _rnn_dropout, _key)
    _LIB.impl("lstm_dropout", _lstm_dropout, _key)


@torch.library.register_fake("fxdream::rnn_dropout", lib=_LIB)
def _(input, hx, params, mode, has_biases, num_layers, bidirectional, batch_first, dropout):
    return torch.ops.fxdream.rnn_inference(input, hx, params, mode, has_biases, num_layers, bidirectional,
                                           batch_first)


@torch.library.register_fake("fxdream::lstm_dropout", lib=_LIB)
def _(input, hx, params, has_biases, num_layers, bidirectional, batch_first, dropout):
    return torch.ops.fxdream.lstm_inference(input, hx, params, has_biases, num_layers, bidirectional, batch_first)


rnn_dropout = torch.ops.fxdream.rnn_dropout.default
lstm_dropout = torch.ops.fxdream.lstm_dropout.default

# A training LSTM on the meta device (a prediction's capture: nothing is computed) as one op and
# its backward as another, the way oneDNN and cuDNN run them, instead of the step-by-step graph
# and gradients ATen would trace there. Meta only: no kernel runs real data through these.
# ``reserve`` stands for what the fused kernels keep for the backward (cuDNN's reserve space,
# oneDNN's workspace): each layer's and direction's gates and cell state, 5 x hidden per step.
_LIB.define("lstm_train(Tensor input, Tensor[] hx, Tensor[] params, bool has_biases, int num_layers, "
            "bool bidirectional, bool batch_first) -> (Tensor, Tensor, Tensor, Tensor)")
_LIB.define("lstm_train_backward(Tensor grad_output, Tensor grad_hy, Tensor grad_cy, Tensor input, Tensor[] hx, "
            "Tensor[] params, Tensor output, Tensor reserve, bool has_biases, int num_layers, bool bidirectional, "
            "bool batch_first) -> (Tensor, Tensor[], Tensor[])")


@torch.library.register_fake("fxdream::lstm_train", lib=_LIB)
def _(input, hx, params, has_biases, num_layers, bidirectional, batch_first):
    output, hy, cy = torch.ops.fxdream.lstm_inference(input, hx, params, has_biases, num_layers, bidirectional,
                                                       batch_first)
    return output, hy, cy, _reserve(input, num_layers, bidirectional, batch_first, 5 * hx[1].shape[-1])


def _reserve(input, num_layers: int, bidirectional: bool, batch_first: bool, width: int):
    """What a fused RNN kernel keeps for its backward: ``width`` values per layer, direction,
    step and batch element."""
    steps, batch = (input.shape[1], input.shape[0]) if batch_first else (input.shape[0], input.shape[1])
    return input.new_empty((num_layers * (2 if bidirectional else 1), steps, batch, width))


@torch.library.register_fake("fxdream::lstm_train_backward", lib=_LIB)
def _(grad_output, grad_hy, grad_cy, input, hx, params, output, reserve, has_biases, num_layers, bidirectional,
      batch_first):
    return torch.empty_like(input), [torch.empty_like(h) for h in hx], [torch.empty_like(p) for p in params]


def _save_for_lstm_backward(ctx, inputs, output):
    input, hx, params, *flags = inputs
    ctx.save_for_backward(input, *hx, *params, output[0], output[3])
    ctx.counts, ctx.flags = (len(hx), len(params)), flags


def _lstm_backward(ctx, grad_output, grad_hy, grad_cy, _grad_reserve):
    saved, (n_hx, n_params) = ctx.saved_tensors, ctx.counts
    input, hx, params = saved[0], list(saved[1:1 + n_hx]), list(saved[1 + n_hx:1 + n_hx + n_params])
    grads = torch.ops.fxdream.lstm_train_backward(grad_output, grad_hy, grad_cy, input, hx, params, saved[-2],
                                                  saved[-1], *ctx.flags)
    return (*grads, None, None, None, None)


torch.library.register_autograd("fxdream::lstm_train", _lstm_backward, setup_context=_save_for_lstm_backward,
                                lib=_LIB)
lstm_train = torch.ops.fxdream.lstm_train.default
lstm_train_backward = torch.ops.fxdream.lstm_train_backward.default

# A training GRU or vanilla RNN on the meta device, as ``lstm_train``: the fused kernels' reserve
# holds each layer's and direction's gate activations per step for the backward (GRU: its three
# gates and the reset-gated hidden term, 4 x hidden; RNN: the pre-activation, 1 x hidden).
RESERVED_PER_HIDDEN = {"gru": 4, "rnn_tanh": 1, "rnn_relu": 1}
_LIB.define("rnn_train(Tensor input, Tensor hx, Tensor[] params, str mode, bool has_biases, int num_layers, "
            "bool bidirectional, bool batch_first) -> (Tensor, Tensor, Tensor)")
_LIB.define("rnn_train_backward(Tensor grad_output, Tensor grad_hy, Tensor input, Tensor hx, Tensor[] params, "
            "Tensor output, Tensor reserve, str mode, bool has_biases, int num_layers, bool bidirectional, "
            "bool batch_first) -> (Tensor, Tensor, Tensor[])")


@torch.library.register_fake("fxdream::rnn_train", lib=_LIB)
def _(input, hx, params, mode, has_biases, num_layers, bidirectional, batch_first):
    output, hy = torch.ops.fxdream.rnn_inference(input, hx, params, mode, has_biases, num_layers, bidirectional,
                                                 batch_first)
    return output, hy, _reserve(input, num_layers, bidirectional, batch_first, RESERVED_PER_HIDDEN[mode] * hx.shape[-1])


@torch.library.register_fake("fxdream::rnn_train_backward", lib=_LIB)
def _(grad_output, grad_hy, input, hx, params, output, reserve, mode, has_biases, num_layers, bidirectional,
      batch_first):
    return torch.empty_like(input), torch.empty_like(hx), [torch.empty_like(p) for p in params]


def _save_for_rnn_backward(ctx, inputs, output):
    input, hx, params, *flags = inputs
    ctx.save_for_backward(input, hx, *params, output[0], output[2])
    ctx.flags = flags


def _rnn_backward(ctx, grad_output, grad_hy, _grad_reserve):
    input, hx, *rest = ctx.saved_tensors
    params, output, reserve = rest[:-2], rest[-2], rest[-1]
    grads = torch.ops.fxdream.rnn_train_backward(grad_output, grad_hy, input, hx, list(params), output, reserve,
                                                 *ctx.flags)
    return (*grads, None, None, None, None, None)


torch.library.register_autograd("fxdream::rnn_train", _rnn_backward, setup_context=_save_for_rnn_backward, lib=_LIB)
rnn_train = torch.ops.fxdream.rnn_train.default
rnn_train_backward = torch.ops.fxdream.rnn_train_backward.default


def _needs_grad(*tensors) -> bool:
    """Whether autograd records a call on these: the op kept whole must then have a gradient
    formula (an RNN in eval mode inside a training step still passes gradients through)."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in tensors)


def _monte_carlo_dropout(input, dropout, train, num_layers, *tensors) -> bool:
    """A stacked RNN in train mode with dropout between its layers, run without gradients on real
    data (an inference build's Monte Carlo dropout): ``rnn_dropout`` / ``lstm_dropout``."""
    return train is True and dropout > 0 and num_layers > 1 and input.device.type != "meta" \
        and not _needs_grad(input, *tensors)


def redirect_lstm(args, kwargs):
    """For an LSTM as nn.LSTM calls ``_VF.lstm`` (9 arguments), outside autocast: in inference
    (train=False) ``lstm_inference(...)`` on a GPU or the meta device, or on a CPU with
    projections or an empty input; in train mode without
    gradients, stacked with dropout, ``lstm_dropout(...)``; in training ``lstm_train(...)`` on the
    meta device; else None."""
    if kwargs or len(args) != 9 or not isinstance(args[1], (tuple, list)):
        return None
    input, (h, c), params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
    if not all(isinstance(t, torch.Tensor) for t in (input, h, c)) or autocast_on(input.device):
        return None
    if _monte_carlo_dropout(input, dropout, train, num_layers, h, c, *params):
        return tuple(lstm_dropout(input, [h, c], list(params), has_biases, num_layers, bidirectional, batch_first,
                                  dropout))
    if train is not False or _needs_grad(input, h, c, *params):
        if input.device.type != "meta":
            return None
        output, hy, cy, _ = lstm_train(input, [h, c], list(params), has_biases, num_layers, bidirectional,
                                              batch_first)
        return output, hy, cy
    projected_on_cpu = input.device.type == "cpu" and h.shape[-1] != c.shape[-1]
    if not (projected_on_cpu or _empty_on_cpu(input) or input.device.type in ("meta", "cuda")):
        return None
    return tuple(lstm_inference(input, [h, c], list(params), has_biases, num_layers, bidirectional, batch_first))


def _empty_on_cpu(input: torch.Tensor) -> bool:
    """An empty CPU input (a batch of 0): torch's LSTM decomposition still picks oneDNN's layer for
    it (its ``use_mkldnn`` has no size check, ATen's has), and that layer dies of a division by
    zero, killing the process; eager's LSTM returns empty outputs. Only sizes fixed at 0 count: a
    symbolic size is never asked, so no guard is added."""
    return input.device.type == "cpu" and any(type(size) is int and size == 0 for size in input.shape)


def redirect_rnn(mode, args, kwargs):
    """For the input-tensor overload of GRU/RNN as nn.GRU / nn.RNN call it (9 arguments),
    outside autocast (it casts the RNN's inputs): ``rnn_inference(...)`` in inference
    (train=False, no gradient recorded), ``rnn_dropout(...)`` in train mode without gradients
    when stacked with dropout, ``rnn_train(...)`` on the meta device otherwise; else None."""
    if kwargs or len(args) != 9 or not isinstance(args[0], torch.Tensor) or not isinstance(args[1], torch.Tensor) \
            or not isinstance(args[2], (list, tuple)) or autocast_on(args[0].device):
        return None  # (the packed-sequence overload has 9 arguments too: data, batch_sizes, hx, params, ...)
    input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first = args
    if _monte_carlo_dropout(input, dropout, train, num_layers, hx, *params):
        return tuple(rnn_dropout(input, hx, list(params), mode, has_biases, num_layers, bidirectional, batch_first,
                                 dropout))
    if train is not False or _needs_grad(input, hx, *params):
        if input.device.type != "meta":
            return None
        output, hy, _ = rnn_train(input, hx, list(params), mode, has_biases, num_layers, bidirectional,
                                         batch_first)
        return output, hy
    return tuple(rnn_inference(input, hx, list(params), mode, has_biases, num_layers, bidirectional, batch_first))
