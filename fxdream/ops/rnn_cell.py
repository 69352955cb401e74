"""RNN cells (``nn.GRUCell``, ``nn.LSTMCell``, ``nn.RNNCell``) as one op in inference graphs.

A cell is one C++ call in eager (``torch._VF.gru_cell`` ...) that runs ~10-20 ATen ops inside;
aot_autograd traces those ops into the graph, where each runs from Python, slower than eager's
one call, and a decoder that steps a cell in a loop pays that every step. ``rnn_cell_inference``
calls the same ``torch._VF`` function at run time (values bit-identical to eager), one node for
the cost model. Inference only, as ``rnn_op``.
"""
from __future__ import annotations

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


def redirect_rnn_cell(function, args, kwargs):
    """``rnn_cell_inference(...)`` for a ``torch._VF`` cell call as the ``nn`` cells make it
    (input, state, weights, biases), outside autocast; else None."""
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
    out = rnn_cell_inference(input, list(states), w_ih, w_hh, b_ih, b_hh, cell)
    return tuple(out) if cell == "lstm_cell" else out[0]
