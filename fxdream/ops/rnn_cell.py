"""RNN cells (``nn.GRUCell``, ``nn.LSTMCell``, ``nn.RNNCell``) as one op in inference graphs,
and a trained LSTM or GRU cell on the meta device as the ops a GPU runs for it.

A cell is one C++ call in eager (``torch._VF.gru_cell`` ...) that runs ~10-20 ATen ops inside;
aot_autograd traces those ops into the graph, where each runs from Python, slower than eager's
one call, and a decoder that steps a cell in a loop pays that every step. ``rnn_cell_inference``
calls the same ``torch._VF`` function at run time (values bit-identical to eager), one node for
the cost model. Inference only, as ``rnn_op``.

In training a cell is traced as ATen splits it, which differs by device: on a CPU (and the meta
device) its gates' pointwise math is ~10 ops forward and ~15 backward; on a GPU an LSTM or GRU
cell is the two gate products and one fused kernel (``_thnn_fused_lstm_cell``, with its own
backward: ATen's RNN.cpp, ``LSTMCell``/``GRUCell`` on CUDA). A capture on the meta device is for
a prediction for another device, so there a trained cell is traced as the GPU's ops, as an LSTM
layer there is the GPU's one op (``rnn.lstm_train``). The GRU's fused ops have no meta kernel in
torch; theirs are registered here (shapes only).
"""
from __future__ import annotations

import contextlib
import contextvars

import torch

from fxdream.ops.autocast import autocast_on

_CELLS = ("gru_cell", "lstm_cell", "rnn_tanh_cell", "rnn_relu_cell")
FUNCTIONS = {getattr(torch._VF, name): name for name in _CELLS}

_LIB = torch.library.Library("fxdream", "FRAGMENT")
_LIB.define("rnn_cell_inference(Tensor input, Tensor[] hx, Tensor w_ih, Tensor w_hh, Tensor? b_ih, Tensor? b_hh, "
            "str cell) -> Tensor[]")


def _cell(input, hx, w_ih, w_hh, b_ih, b_hh, cell):
    function = getattr(torch._VF, cell)
    if cell == "lstm_cell":
        return list(function(input, tuple(hx), w_ih, w_hh, b_ih, b_hh))
    return [function(input, hx[0], w_ih, w_hh, b_ih, b_hh)]


for _key in ("CPU", "CUDA"):
    _LIB.impl("rnn_cell_inference", _cell, _key)


@torch.library.register_fake("fxdream::rnn_cell_inference", lib=_LIB)
def _(input, hx, w_ih, w_hh, b_ih, b_hh, cell):
    # the new hidden state (and an LSTM's cell state): new tensors of the states' shapes
    return [h.new_empty(h.shape) for h in (hx if cell == "lstm_cell" else hx[:1])]


rnn_cell_inference = torch.ops.fxdream.rnn_cell_inference.default


# the GRU's fused kernels as ATen's CUDA ones shape their outputs: the new hidden state and a
# workspace of 5 × hidden per row; the backward's gate, state and bias gradients
def _fused_gru_cell(input_gates, hidden_gates, hx, input_bias=None, hidden_bias=None):
    return hx.new_empty(hx.shape), hx.new_empty((hx.shape[0], 5 * hx.shape[1]))


def _fused_gru_cell_backward(grad_hy, workspace, has_bias):
    rows, hidden = grad_hy.shape
    gates = grad_hy.new_empty((rows, 3 * hidden))
    bias = grad_hy.new_empty((3 * hidden,) if has_bias else (0,))
    return gates, gates.new_empty(gates.shape), grad_hy.new_empty(grad_hy.shape), bias, bias.new_empty(bias.shape)


for _op, _fake in (("aten::_thnn_fused_gru_cell", _fused_gru_cell),
                   ("aten::_thnn_fused_gru_cell_backward", _fused_gru_cell_backward)):
    if not torch._C._dispatch_has_kernel_for_dispatch_key(_op, "Meta"):  # a torch that has one keeps it
        torch.library.register_fake(_op)(_fake)


_CELLS_AS_ON_GPU = contextvars.ContextVar("fxdream_cells_as_on_gpu", default=True)


@contextlib.contextmanager
def cells_as_on(device_kind: str):
    """While a capture is for a prediction of a ``device_kind`` device ("cuda", "cpu"): a trained
    cell on the meta device is traced as that device splits it (a GPU: ``_as_on_gpu``)."""
    token = _CELLS_AS_ON_GPU.set(device_kind != "cpu")
    try:
        yield
    finally:
        _CELLS_AS_ON_GPU.reset(token)


def _as_on_gpu(cell, input, states, w_ih, w_hh, b_ih, b_hh):
    """An LSTM or GRU cell as ATen runs it on a GPU: the gate products, then the fused kernel."""
    input_gates, hidden_gates = input.matmul(w_ih.t()), states[0].matmul(w_hh.t())
    if cell == "lstm_cell":
        hy, cy, _ = torch.ops.aten._thnn_fused_lstm_cell(input_gates, hidden_gates, states[1], b_ih, b_hh)
        return hy, cy
    return torch.ops.aten._thnn_fused_gru_cell(input_gates, hidden_gates, states[0], b_ih, b_hh)[0]


def redirect_rnn_cell(function, args, kwargs):
    """For a ``torch._VF`` cell call as the ``nn`` cells make it (input, state, weights,
    biases), outside autocast: in inference ``rnn_cell_inference(...)``; while a gradient is
    recorded, an LSTM or GRU cell on the meta device as a GPU runs it (``_as_on_gpu``) unless the
    capture is for a CPU (``cells_as_on``); else None."""
    cell = FUNCTIONS.get(function)
    if cell is None or kwargs or len(args) not in (4, 6):
        return None
    input, hx, w_ih, w_hh = args[:4]
    b_ih, b_hh = args[4:] if len(args) == 6 else (None, None)
    states = tuple(hx) if cell == "lstm_cell" and isinstance(hx, (tuple, list)) else (hx,)
    if len(states) != (2 if cell == "lstm_cell" else 1) \
            or not all(isinstance(t, torch.Tensor) for t in (input, *states, w_ih, w_hh)) \
            or autocast_on(input.device):  # autocast casts the cell's inputs
        return None
    if torch.is_grad_enabled():
        # (torch's meta kernel of the fused LSTM cell reads its biases' devices: an LSTM cell
        # without biases stays split)
        on_gpu_here = (cell == "gru_cell" or (cell == "lstm_cell" and b_ih is not None)) \
            and input.device.type == "meta" and _CELLS_AS_ON_GPU.get()
        return _as_on_gpu(cell, input, states, w_ih, w_hh, b_ih, b_hh) if on_gpu_here else None
    out = rnn_cell_inference(input, list(states), w_ih, w_hh, b_ih, b_hh, cell)
    return tuple(out) if cell == "lstm_cell" else out[0]
