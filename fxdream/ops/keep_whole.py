"""While a capture traces a graph: calls of the functions fxdream keeps whole become one op each."""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from fxdream.ops.max_pool1d import FUNCTIONS as MAX_POOL1D_FUNCTIONS
from fxdream.ops.max_pool1d import redirect_max_pool1d
from fxdream.ops.pad import FUNCTIONS as PAD_FUNCTIONS
from fxdream.ops.pad import redirect_pad
from fxdream.ops.rnn import FUNCTIONS as RNN_FUNCTIONS
from fxdream.ops.rnn import redirect_lstm, redirect_rnn
from fxdream.ops.rnn_cell import FUNCTIONS as CELL_FUNCTIONS
from fxdream.ops.rnn_cell import redirect_rnn_cell
from fxdream.ops.sdpa import meta_attention_redirected, redirect_attention
from fxdream.ops.upsample import FUNCTIONS as UPSAMPLE_FUNCTIONS
from fxdream.ops.upsample import redirect_upsample, upsample_calls_redirected

# torch function → (args, kwargs) → the whole op's call, or None to trace the call as it is
_REDIRECTS = {**{f: functools.partial(redirect_rnn, mode) for mode, f in RNN_FUNCTIONS.items()},
              **{f: functools.partial(redirect_upsample, f) for f in UPSAMPLE_FUNCTIONS},
              **{f: redirect_pad for f in PAD_FUNCTIONS},
              **{f: redirect_max_pool1d for f in MAX_POOL1D_FUNCTIONS},
              **{f: functools.partial(redirect_rnn_cell, f) for f in CELL_FUNCTIONS},
              torch._VF.lstm: redirect_lstm,
              F.scaled_dot_product_attention: redirect_attention}


# whole ops with a gradient formula (RNNs' and SDPA's on the meta device only: ``rnn.lstm_train``,
# ``rnn.rnn_train``, ``sdpa.fused_on_meta``)
_DIFFERENTIABLE = frozenset({F.interpolate, *UPSAMPLE_FUNCTIONS, torch._VF.lstm, *RNN_FUNCTIONS.values(),
                             *CELL_FUNCTIONS, F.scaled_dot_product_attention, F.multi_head_attention_forward})


class _KeepOpsWhole(TorchFunctionMode):
    """Redirects (``_REDIRECTS``) GRU/RNN layers to ``rnn_inference``, an LSTM on a GPU, on the
    meta device or with projections on a CPU to ``lstm_inference``, RNN cells, upsampling, circular
    padding and 1-d max pooling to their ops (rnn_cell_op, upsample_op, pad_op, max_pool1d_op),
    and on a GPU SDPA to ``fxdream::attention_inference`` (sdpa_op); on the meta device SDPA to
    the fused kernel a GPU runs (``sdpa.fused_on_meta``). While a training graph is traced, only
    what has a gradient formula: upsampling, and on the meta device RNNs (``lstm_train``, ``rnn_train``),
    LSTM and GRU cells (as a GPU runs them: ``rnn_cell``) and SDPA."""

    def __init__(self, training: bool = False):
        super().__init__()
        self.training = training

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if self.training and func not in _DIFFERENTIABLE:
            return func(*args, **(kwargs or {}))
        if func is F.interpolate:  # what it calls is redirected below
            with upsample_calls_redirected():
                return func(*args, **(kwargs or {}))
        if func is F.multi_head_attention_forward:  # the SDPA it calls, on the meta device
            with meta_attention_redirected():
                return func(*args, **(kwargs or {}))
        redirect = _REDIRECTS.get(func)
        if redirect is not None:
            kept = redirect(args, kwargs or {})
            if kept is not None:
                return kept
        return func(*args, **(kwargs or {}))


def keep_ops_whole(gm: torch.fx.GraphModule | None = None):
    """While tracing a graph: in inference GRU/RNN layers (and an LSTM on a GPU, on the meta device
    or with projections on a CPU), RNN cells, upsampling, circular padding and 1-d max pooling become one
    node each (and SDPA on a GPU one ``attention_inference``); in training upsampling (and on the
    meta device RNNs, LSTM/GRU cells as a GPU's ops, and SDPA) only. On the meta device SDPA is
    the fused kernel. Given the graph about to be traced, only if it may call one: the mode's
    Python hook on every torch call would slow the capture of a graph that calls none."""
    training = torch.is_grad_enabled()
    if gm is not None and not may_call_whole_ops(gm, training):
        return contextlib.nullcontext()
    return _KeepOpsWhole(training)


_WHOLE_FUNCTIONS = (F.interpolate, F.multi_head_attention_forward, *_REDIRECTS)


# torch.nn modules a graph may call as leaves (torch.fx's default) that call one of those inside
_WHOLE_MODULES = (torch.nn.RNNBase, torch.nn.RNNCellBase, torch.nn.Upsample, torch.nn.MaxPool1d,
                  torch.nn.modules.padding._CircularPadNd, torch.nn.MultiheadAttention,
                  torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer, torch.nn.TransformerEncoder,
                  torch.nn.TransformerDecoder, torch.nn.Transformer)


def may_call_whole_ops(gm: torch.fx.GraphModule, training: bool = False) -> bool:
    """Whether ``gm`` calls a function kept whole (in ``training``, one with a gradient formula),
    directly or in a leaf module; True when unsure (a call into Python code that is not a torch op)."""
    functions, modules = ((_DIFFERENTIABLE, (torch.nn.Upsample, torch.nn.RNNBase, torch.nn.RNNCellBase)) if training
                          else (_WHOLE_FUNCTIONS, _WHOLE_MODULES))
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
    Python hook on every torch call the profile would count as op time."""
    if isinstance(torch.overrides._get_current_function_mode(), _KeepOpsWhole):  # private, isolated
        with torch.overrides._pop_mode_temporarily():
            yield
    else:
        yield
