"""FLOPs of one node: torch.utils.flop_counter's formulas, plus SDPA and RNN ops it has none for.

fxdream's own whole ops (``fxdream::rnn_inference``, ``fxdream::attention_inference``) are
known here by name, so this module needs no import of the ops that define them."""
from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.flop_counter import flop_registry, sdpa_backward_flop_count

from fxdream.ir.nodes import node_bytes, node_dtype, op_name, value_of
from fxdream.ir.tensors import tensor_bytes

GEMM_OPS = frozenset({"aten.mm", "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.linear", "aten._scaled_mm"})
CONV_OPS = frozenset({"aten.convolution", "aten.convolution_backward", "aten.cudnn_convolution",
                      "aten._convolution", "fxdream.conv_fused_inference", "fxdream.conv_bias_relu",
                      "fxdream.conv_bias_add_relu"})
BATCH_NORM_OPS = frozenset({"aten.native_batch_norm", "aten._native_batch_norm_legit",
                            "aten._native_batch_norm_legit_functional", "aten._native_batch_norm_legit_no_training",
                            "aten.native_batch_norm_backward", "aten.cudnn_batch_norm",
                            "aten.cudnn_batch_norm_backward",
                            "aten.miopen_batch_norm", "aten.miopen_batch_norm_backward"})
KERNEL_CLASSES = ("conv", "conv_1x1", "gemm", "batch_norm", "other")
CONV_CLASSES = frozenset({"conv", "conv_1x1"})
# Batch norms in training pass over their data more than once: the forward reads its input for
# the statistics and again to normalize (2x + y over the x + y its tensors count: 1.5x), the
# backward reads grad_output and input for its reductions and again for grad_input (5/3x). The
# kernels take about twice that: the factors below are those with which one fitted batch-norm
# model sums the H200's per-op records (benchmarks/results/gpu_op_profile_h200_*) as closely
# for training steps as for inference (0.7-0.9x of the measured kernel time for both; with the
# pass counts alone, training summed to 0.55x).
_TRAINING_READS = {"forward": 3.0, "backward": 3.3}
_BACKWARD_BATCH_NORMS = frozenset({"aten.native_batch_norm_backward", "aten.cudnn_batch_norm_backward",
                                   "aten.miopen_batch_norm_backward"})
_TRAINING_ARG = 5  # native_batch_norm, _native_batch_norm_legit(_functional), cudnn/miopen_batch_norm


def kernel_class(node: fx.Node) -> str:
    """"conv" (convolutions with a spatial kernel, and their gradients), "conv_1x1" (pointwise
    convolutions: a GEMM over the positions, which cuDNN runs at about twice the share of the
    roofline a 3x3 reaches, with less than half its startup: the H200's per-op records),
    "gemm" (matrix products, attention), "batch_norm" (batch norm and its gradient:
    per-channel reductions over the batch) or "other" (pointwise, copies, other norms and
    reductions: memory-bound). Libraries reach different shares of the roofline on each
    (``DeviceSpec.roofline_share``)."""
    name = op_name(node)
    if name in CONV_OPS:
        return "conv_1x1" if _pointwise_kernel(node, name) else "conv"
    if name in GEMM_OPS or name in _SDPA_OPS or "scaled_dot_product" in name:
        return "gemm"
    if name in BATCH_NORM_OPS:
        return "batch_norm"
    return "other"


def _pointwise_kernel(node: fx.Node, name: str) -> bool:
    """Whether a convolution op's weight has a 1-wide kernel in every spatial dimension (the
    weight is the third argument of a convolution's backward, the second of the others)."""
    position = 2 if name == "aten.convolution_backward" else 1
    weight = value_of(node.args[position]) if len(node.args) > position else None
    return isinstance(weight, torch.Tensor) and pointwise_weight_shape(weight.shape)


def pointwise_weight_shape(shape) -> bool:
    """Whether a convolution weight of ``shape`` (out, in, *kernel) has a 1-wide kernel in every
    spatial dimension (what makes its convolution "conv_1x1")."""
    return len(shape) >= 3 and all(size == 1 for size in shape[2:])


def traffic_factor(op: str, dtype: str, training: bool | None = None) -> float:
    """The memory traffic of one kernel over the bytes of its tensors. Batch-norm kernels compute
    in float32 whatever their tensors' dtype (PyTorch's accumulate type), so a half-precision one
    takes the time of float32 traffic; in training they pass over their data more than once
    (``_TRAINING_READS``). ``training``: the op's flag where it has one (None: the backward and
    ``_native_batch_norm_legit_functional`` are training ops, others not). 1 for other ops."""
    if op not in BATCH_NORM_OPS:
        return 1.0
    width = 2.0 if dtype in ("float16", "bfloat16") else 1.0
    if op in _BACKWARD_BATCH_NORMS:
        return width * _TRAINING_READS["backward"]
    if training is None:
        training = op == "aten._native_batch_norm_legit_functional"
    return width * (_TRAINING_READS["forward"] if training else 1.0)


def node_traffic_factor(node: fx.Node) -> float:
    """``traffic_factor`` of one node, its training flag read where its op has one."""
    name = op_name(node)
    training = None
    if name in BATCH_NORM_OPS and name not in _BACKWARD_BATCH_NORMS and len(node.args) > _TRAINING_ARG:
        flag = node.args[_TRAINING_ARG]
        training = flag if isinstance(flag, bool) else None
    return traffic_factor(name, node_dtype(node), training)


def kernel_bytes(node: fx.Node) -> float:
    """Bytes of memory traffic one node's kernels take the time of: its tensors' bytes
    (``node_bytes``) times ``node_traffic_factor``. Each kernel of a ``convolution_backward``
    reads grad_output, input and weight, which its tensors count once: a fused call and its
    parts split one per kernel (``aux_stream_backward``) move alike."""
    rereads = 0
    if op_name(node) == "aten.convolution_backward" and len(node.args) == 11:
        rereads = (kernel_count(node) - 1) * tensor_bytes([value_of(a) for a in node.args[:3]])
    return node_bytes(node) * node_traffic_factor(node) + rereads


def kernel_count(node: fx.Node) -> int:
    """Kernels one node launches: a ``convolution_backward`` one per gradient it computes
    (data, weight, bias: its output mask), any other op one."""
    if op_name(node) == "aten.convolution_backward" and len(node.args) == 11:
        return max(1, sum(bool(m) for m in node.args[10]))
    return 1


def node_flops(node: fx.Node) -> int:
    """FLOPs of one node from torch.utils.flop_counter's formulas on its fake tensors."""
    packet = getattr(node.target, "overloadpacket", None)
    if op_name(node) in _RNN_OPS:
        return _rnn_flops(node)
    if op_name(node) in _SDPA_OPS:
        return _sdpa_flops(node)
    if op_name(node) == _CPU_SDPA_BACKWARD:
        return _cpu_sdpa_backward_flops(node)
    if op_name(node) in _FAST_PATH_TRANSFORMER_OPS:
        return _fast_path_transformer_flops(node)
    formula = flop_registry.get(packet) if packet is not None else None
    if formula is None:
        return 0
    args = torch.utils._pytree.tree_map(value_of, node.args)
    kwargs = torch.utils._pytree.tree_map(value_of, node.kwargs)
    try:
        return int(formula(*args, **kwargs, out_val=node.meta.get("val")))
    except Exception:  # a formula that cannot read symbolic or missing shapes
        return 0


_SDPA_OPS = frozenset({"aten.scaled_dot_product_attention", "aten._scaled_dot_product_flash_attention_for_cpu",
                       "fxdream.attention_inference"})


def _sdpa_flops(node: fx.Node) -> int:
    """SDPA forward (no formula in flop_counter for the composite op and the CPU kernel): q·kᵀ
    and probs·v, 2·b·h·s·t·(d + dv) FLOPs (the softmax is left out, as flop_counter does)."""
    q, k, v = (value_of(a) for a in node.args[:3])
    if not all(isinstance(t, torch.Tensor) and t.dim() >= 2 for t in (q, k, v)):
        return 0
    batch = q.numel() // (q.shape[-2] * q.shape[-1])
    return int(2 * batch * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1]))


_CPU_SDPA_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward"


def _cpu_sdpa_backward_flops(node: fx.Node) -> int:
    """The CPU flash attention's backward (no formula in flop_counter, which has the GPU
    kernels'): that of the GPU kernels' backward, q·kᵀ recomputed and four products for the
    gradients (``sdpa_backward_flop_count``)."""
    grad_out, q, k, v = (value_of(a) for a in node.args[:4])
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (grad_out, q, k, v)):
        return 0
    return int(sdpa_backward_flop_count(grad_out.shape, q.shape, k.shape, v.shape))


# torch's fast-path kernels for nn.TransformerEncoderLayer / nn.MultiheadAttention in eval
# (batch-first inputs): whole layers as one op, which flop_counter has no formula for.
_FAST_PATH_TRANSFORMER_OPS = frozenset({"aten._transformer_encoder_layer_fwd", "aten._native_multi_head_attention"})


def _fast_path_transformer_flops(node: fx.Node) -> int:
    """The GEMMs of a fast-path layer, 2·m·n·k each: the q/k/v and output projections, q·kᵀ and
    probs·v over all heads (the embedding width), and for an encoder layer its feed-forward
    block (``ffn_weight_1`` is F×E). Softmax, norms and activations are left out, as
    flop_counter does. Arguments: ``_transformer_encoder_layer_fwd(src, E, heads, qkv_weight,
    qkv_bias, proj_weight, proj_bias, use_gelu, norm_first, eps, norm 1 and 2 weights and
    biases, ffn_weight_1, ...)``; ``_native_multi_head_attention(query, key, value, E, ...)``."""
    encoder = op_name(node) == "aten._transformer_encoder_layer_fwd"
    query = value_of(node.args[0])
    key = query if encoder else value_of(node.args[1])
    width = node.args[1] if encoder else node.args[3]
    if not (isinstance(query, torch.Tensor) and isinstance(key, torch.Tensor) and query.dim() == key.dim() == 3
            and isinstance(width, int)) or query.is_nested:
        return 0
    batch, queries, keys = query.shape[0], query.shape[1], key.shape[1]
    projections = 2 * width * width * (2 * batch * queries + 2 * batch * keys)  # q and output; k and v
    attention = 2 * 2 * batch * queries * keys * width
    ffn = value_of(node.args[14]) if encoder and len(node.args) > 14 else None
    feed_forward = 2 * 2 * batch * queries * width * ffn.shape[0] if isinstance(ffn, torch.Tensor) else 0
    return int(projections + attention + feed_forward)


_RNN_OPS = frozenset({"aten.lstm", "aten.gru", "aten.rnn_tanh", "aten.rnn_relu", "aten.mkldnn_rnn_layer",
                      "aten._cudnn_rnn", "fxdream.rnn_inference", "fxdream.lstm_inference", "fxdream.lstm_train",
                      "fxdream.lstm_train_backward", "fxdream.rnn_train", "fxdream.rnn_train_backward",
                      "fxdream.rnn_cell_inference", "fxdream.rnn_dropout", "fxdream.lstm_dropout"})
# where an op's weight matrices are, where its other arguments hold 2-d tensors that are not
# weights: a cell's hx; oneDNN's layer without biases, zeros of the weights' shapes in their place
_RNN_WEIGHT_ARGS = {"fxdream.rnn_cell_inference": slice(2, 4), "aten.mkldnn_rnn_layer": slice(1, 3)}
_RNN_BACKWARD_OPS = frozenset({"fxdream.lstm_train_backward", "fxdream.rnn_train_backward"})


def _rnn_flops(node: fx.Node) -> int:
    """RNN ops (no formula in flop_counter): every weight matrix (4H×I, 4H×H for an LSTM,
    per layer and direction) multiplies every sequence element: 2·rows·cols FLOPs each. A cell
    (``fxdream.rnn_cell_inference``: input, hx, w_ih, w_hh, ...) is one step over its batch;
    oneDNN's layer (``aten.mkldnn_rnn_layer``: input, w_ih, w_hh, b_ih, b_hh, ...) one layer."""
    x = value_of(node.args[0])
    if not isinstance(x, torch.Tensor) or x.dim() not in (2, 3):
        return 0
    tokens = x.shape[0] * (x.shape[1] if x.dim() == 3 else 1)
    candidates = node.args[_RNN_WEIGHT_ARGS.get(op_name(node), slice(1, None))]
    weights = [w for w in torch.utils._pytree.tree_leaves(torch.utils._pytree.tree_map(value_of, candidates))
               if isinstance(w, torch.Tensor) and w.dim() == 2 and w is not x]
    backward = 2 if op_name(node) in _RNN_BACKWARD_OPS else 1  # the input's and the weights' gradients
    return int(backward * sum(2 * tokens * w.shape[0] * w.shape[1] for w in weights))


# (index of num_layers, of bidirectional, of batch_first) in each RNN op's arguments
_RNN_LAYOUT_ARGS = {**{f"aten.{name}": (4, 7, 8) for name in ("lstm", "gru", "rnn_tanh", "rnn_relu")},
                    **dict.fromkeys(("fxdream.rnn_inference", "fxdream.rnn_train", "fxdream.rnn_dropout"), (5, 6, 7)),
                    **dict.fromkeys(("fxdream.lstm_inference", "fxdream.lstm_train", "fxdream.lstm_dropout"),
                                    (4, 5, 6)),
                    **dict.fromkeys(_RNN_BACKWARD_OPS, (9, 10, 11)), "aten._cudnn_rnn": (9, 13, 10)}


def _rnn_layout(node: fx.Node) -> tuple[int, int, int] | None:
    """(time steps, layers, directions) of an RNN op; None for other ops and for oneDNN's
    per-layer op (timed on the CPU anyway)."""
    where = _RNN_LAYOUT_ARGS.get(op_name(node))
    x = value_of(node.args[0]) if node.args else None
    if where is None or not isinstance(x, torch.Tensor) or len(node.args) <= max(where):
        return None
    layers, bidirectional, batch_first = (node.args[i] for i in where)
    if not isinstance(layers, int) or x.dim() not in (2, 3):
        return None
    steps = x.shape[1] if x.dim() == 3 and batch_first else x.shape[0]
    return int(steps), layers, 2 if bidirectional else 1


def rnn_sequential_steps(node: fx.Node) -> int:
    """Time steps × layers of an RNN op: the recurrence runs them one after another, whatever
    the FLOPs (0 for other ops)."""
    layout = _rnn_layout(node)
    return 0 if layout is None else layout[0] * layout[1]


def rnn_kernel_launches(node: fx.Node) -> int:
    """Kernels an RNN op launches on a GPU, each a launch the host pays for: per layer and
    direction one GEMM over all steps' inputs, then per step a recurrent GEMM and a pointwise
    kernel (cuDNN's standard algorithm); a backward twice that (the data gradients step by step,
    then the weights'). 0 for other ops."""
    layout = _rnn_layout(node)
    if layout is None:
        return 0
    steps, layers, directions = layout
    return (2 if op_name(node) in _RNN_BACKWARD_OPS else 1) * layers * directions * (1 + 2 * steps)
