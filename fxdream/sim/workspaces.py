"""Memory an op allocates and frees again while it runs, beyond its outputs: its task in the
timeline holds it from start to end.

The rules are ATen's own choices on a CPU, each checked against the allocator's records of
one call (torch.profiler, ``profile_memory=True``):

* ``aten.mkldnn_rnn_layer`` (an LSTM layer through oneDNN) copies its weights and bias into
  oneDNN's layout on every call and keeps a scratch of the gates: input-to-hidden and
  hidden-to-hidden weights, the bias, and time × batch × 4 × hidden values. A whole LSTM
  (``fxdream::lstm_inference``, as a meta-device capture keeps it) runs its layers so, one by one.
* A float convolution on a CPU goes through oneDNN unless ATen takes its slow path (below).
  oneDNN computes in its blocked layout: from a contiguous (NCHW) input it reorders the input
  (not with at most ``PLAIN_SOURCE_CHANNELS`` input channels, which it reads as they are) and
  the weight, computes a blocked output, then reorders that into the output. Beside the output
  the simulator already holds, that is the larger of (input + weight) and the blocked output,
  whose channels are padded up to ``CHANNEL_BLOCK`` (an 8-channel output's is twice its size
  with AVX-512). Some channel pairs (16 → 8, 24 → 40) reorder more than this inside the op;
  that is not modelled (docs/measurements.md). Where the
  input or the weight is channels_last (ATen runs the convolution channels_last then; a trace on
  the meta device may give the input contiguous strides) only the weight is reordered. A
  prepacked convolution (a pass's) reorders nothing and is not ``aten.convolution``.
* ATen's slow path (``_slow_conv2d``, where its heuristic finds oneDNN slower: batch 1, one
  group, a kernel of at most 3 on a side, an input of at most ``SLOW_PATH_MAX_NUMEL`` values)
  unfolds the input into columns: channels × kernel area × output positions values.
* A convolution's backward on a CPU reorders the incoming gradient, the input and the weight
  (NCHW), the weight alone (channels_last), or unfolds columns again (the slow path).

On a GPU (cuDNN, read off the allocator's peak around each op on an H200:
``benchmarks/gpu_op_profile.py``'s ``transient_bytes``):

* A half-precision convolution on NCHW tensors runs cuDNN's tensor-core kernels in NHWC where
  both channel counts are multiples of ``TENSOR_CORE_CHANNELS``: it holds NHWC copies of its
  input, weight and output while it runs. Not 1x1 stride-1 convolutions over at least
  ``GEMM_1X1_MIN_POSITIONS`` positions, which it runs as they are (a GEMM). Right in 318 of
  344 forward records (under 1 MiB measured where nothing is held, else 0.75-1.35x the
  allocator's reading; the rest, stems with 3 input channels among them, are the algorithm's
  own choice), 0.9x their total.
* Its backward likewise holds copies of the incoming gradient, the input and the weight (0.95x
  the records' total; the single records vary more).
Other workspaces (float32 convolutions, cuBLAS's) depend on the algorithm chosen at run time:
none is held here (a cost model may add what it knows: ``OccupancyAware.workspace_bytes``).
"""
from __future__ import annotations

import math

import torch
import torch.fx as fx

from fxdream.ir.nodes import op_name, value_of
from fxdream.ir.tensors import tensor_bytes, without_symbols

PLAIN_SOURCE_CHANNELS = 4    # oneDNN reads an NCHW source with this many channels or fewer as it is
SLOW_PATH_MAX_NUMEL = 20480  # ATen's ConvParams::use_mkldnn: a smaller batch-1 input takes the slow path
# oneDNN's blocked layouts (nChw16c, OIhw16i16o) pad channels up to a multiple of the block: 16
# with AVX-512, 8 below it (an 8-channel output's blocked copy is twice its size there)
CHANNEL_BLOCK = 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8
TENSOR_CORE_CHANNELS = 8      # cuDNN's NHWC tensor-core kernels take channel counts in multiples of 8
GEMM_1X1_MIN_POSITIONS = 196  # a 1x1 stride-1 convolution over 14x14 positions or more runs as it is
HALF_DTYPES = (torch.float16, torch.bfloat16)


def workspace_bytes(node: fx.Node, device_kind: str) -> int:
    """Bytes ``node``'s op holds while it runs beyond its outputs (0 where no rule applies)."""
    name = op_name(node) if node.op == "call_function" else ""
    if name == "aten.mkldnn_rnn_layer":
        return _rnn_layer_bytes(node)
    if name == "fxdream.lstm_inference" and device_kind == "cpu":
        return _whole_lstm_bytes(node)
    if name == "aten.convolution" and device_kind == "cpu":
        return _cpu_convolution_bytes(node)
    if name == "aten.convolution_backward" and device_kind == "cpu":
        return _cpu_convolution_backward_bytes(node)
    if name == "aten.convolution" and device_kind == "cuda":
        return _gpu_convolution_bytes(node)
    if name == "aten.convolution_backward" and device_kind == "cuda":
        return _gpu_convolution_backward_bytes(node)
    return 0


def _rnn_layer_bytes(node: fx.Node) -> int:
    x, w_ih, w_hh, b_ih = (_hinted_value(a) for a in node.args[:4])
    hidden, batch_first = node.args[10], node.args[14]
    if not all(isinstance(t, torch.Tensor) for t in (x, w_ih, w_hh)):
        return 0
    return tensor_bytes(w_ih) + tensor_bytes(w_hh) + tensor_bytes(b_ih) + _gates_bytes(x, int(hidden), batch_first)


def _whole_lstm_bytes(node: fx.Node) -> int:
    """An LSTM kept whole (``fxdream::lstm_inference``, a meta-device capture) runs on a CPU as
    one oneDNN layer per layer and direction, one after another: the largest one's workspace.
    With projections (oneDNN takes none; ATen's loop runs) nothing is held."""
    x, hx = _hinted_value(node.args[0]), [_hinted_value(h) for h in node.args[1]]
    params = [_hinted_value(p) for p in node.args[2]]
    has_biases, batch_first = node.args[3], node.args[6]
    per_layer = 4 if has_biases else 2
    if not isinstance(x, torch.Tensor) or len(hx) != 2 or hx[0].shape[-1] != hx[1].shape[-1] or len(params) % per_layer:
        return 0
    layers = [params[i:i + per_layer] for i in range(0, len(params), per_layer)]
    return max(sum(tensor_bytes(t) for t in layer[:3]) for layer in layers) + _gates_bytes(
        x, int(hx[1].shape[-1]), batch_first)


def _gates_bytes(x: torch.Tensor, hidden: int, batch_first: bool) -> int:
    """An LSTM layer's gates over the sequence: time steps × batch × 4 × hidden values."""
    time_steps, batch = (x.shape[1], x.shape[0]) if batch_first else (x.shape[0], x.shape[1])
    return int(time_steps) * int(batch) * 4 * hidden * x.element_size()


def _cpu_convolution_bytes(node: fx.Node) -> int:
    x, w, out = _hinted_value(node.args[0]), _hinted_value(node.args[1]), without_symbols(node.meta.get("val"))
    transposed, groups = node.args[6], node.args[8]
    if not all(isinstance(t, torch.Tensor) for t in (x, w, out)) or transposed or not x.is_floating_point():
        return 0
    if x.dim() == 4 and _slow_path(x, w, groups):
        return _columns_bytes(x, w, out, groups, node.args[3], node.args[4])
    if _channels_last(x) or _channels_last(w):  # ATen's rule for channels_last: the weight alone is reordered
        return tensor_bytes(w)
    source = tensor_bytes(x) if x.shape[1] > PLAIN_SOURCE_CHANNELS else 0
    return max(source + tensor_bytes(w), _blocked_bytes(out, (1,)))


def _cpu_convolution_backward_bytes(node: fx.Node) -> int:
    """The backward of an NCHW convolution reorders the incoming gradient, the input and the
    weight into oneDNN's layout (their sizes, within 0.1 % of the allocator's peak at the shapes
    measured); channels_last, the weight alone; ATen's slow path, its columns again."""
    grad_output, x, w = (_hinted_value(a) for a in node.args[:3])
    transposed, groups = node.args[7], node.args[9]
    if not all(isinstance(t, torch.Tensor) for t in (grad_output, x, w)) or transposed or not x.is_floating_point():
        return 0
    if x.dim() == 4 and _slow_path(x, w, groups):
        return _columns_bytes(x, w, grad_output, groups, node.args[4], node.args[5])
    if _channels_last(x) or _channels_last(w):
        return tensor_bytes(w)
    return tensor_bytes(grad_output) + tensor_bytes(x) + tensor_bytes(w)


def _gpu_convolution_bytes(node: fx.Node) -> int:
    x, w, out = _hinted_value(node.args[0]), _hinted_value(node.args[1]), without_symbols(node.meta.get("val"))
    if not all(isinstance(t, torch.Tensor) for t in (x, w, out)) or not _nhwc_on_tensor_cores(x, w, node.args[6]):
        return 0
    one_by_one = tuple(w.shape[-2:]) == (1, 1) and all(s == 1 for s in node.args[3])
    if one_by_one and math.prod(int(d) for d in x.shape[2:]) >= GEMM_1X1_MIN_POSITIONS:
        return 0
    return tensor_bytes(x) + tensor_bytes(w) + tensor_bytes(out)


def _gpu_convolution_backward_bytes(node: fx.Node) -> int:
    grad_output, x, w = (_hinted_value(a) for a in node.args[:3])
    if not all(isinstance(t, torch.Tensor) for t in (grad_output, x, w)) or not _nhwc_on_tensor_cores(
            x, w, node.args[7]):
        return 0
    return tensor_bytes(grad_output) + tensor_bytes(x) + tensor_bytes(w)


def _nhwc_on_tensor_cores(x: torch.Tensor, w: torch.Tensor, transposed: bool) -> bool:
    """A half-precision 2-d convolution on NCHW tensors whose channel counts cuDNN's NHWC
    tensor-core kernels take."""
    return (x.dtype in HALF_DTYPES and x.dim() == 4 and not transposed and not _channels_last(x)
            and not _channels_last(w) and int(w.shape[0]) % TENSOR_CORE_CHANNELS == 0
            and int(w.shape[1]) % TENSOR_CORE_CHANNELS == 0)


def _blocked_bytes(t: torch.Tensor, channel_dims: tuple[int, ...]) -> int:
    """Bytes of ``t`` in oneDNN's blocked layout: each of ``channel_dims`` padded up to a multiple
    of ``CHANNEL_BLOCK``."""
    shape = [int(s) for s in t.shape]
    for dim in channel_dims:
        shape[dim] = -(-shape[dim] // CHANNEL_BLOCK) * CHANNEL_BLOCK
    return math.prod(shape) * t.element_size()


def _channels_last(x: torch.Tensor) -> bool:
    layout = {4: torch.channels_last, 5: torch.channels_last_3d}.get(x.dim())
    return layout is not None and x.is_contiguous(memory_format=layout) and not x.is_contiguous()


def _slow_path(x: torch.Tensor, w: torch.Tensor, groups: int) -> bool:
    large_kernel = w.shape[-1] > 3 and w.shape[-2] > 3
    return (x.dtype == torch.float32 and groups == 1 and int(x.shape[0]) == 1 and not large_kernel
            and int(x.numel()) <= SLOW_PATH_MAX_NUMEL)


def _columns_bytes(x, w, out, groups: int, stride, padding) -> int:
    """The unfolded input of ATen's slow convolution; none for a 1x1 kernel at stride 1 without padding."""
    if tuple(w.shape[-2:]) == (1, 1) and all(s == 1 for s in stride) and not any(padding):
        return 0
    columns = (int(x.shape[1]) // groups) * math.prod(int(k) for k in w.shape[-2:]) * math.prod(
        int(d) for d in out.shape[-2:])
    return int(x.shape[0]) * columns * x.element_size()


def _hinted_value(arg):
    """``value_of(arg)`` with its symbolic sizes read at their hints (``without_symbols``)."""
    return without_symbols(value_of(arg))
