"""How much of the GPU one GEMM-like kernel fills: the ``utilization`` the contention model needs.

Why not output elements: ``Analytic.utilization`` (output elements over resident threads)
makes every weight gradient look tiny (a 512x512x3x3 wgrad has 2.4M outputs, whatever the
batch), so two streams would be predicted to overlap it for free even at batch 256, where
the seed (MXNet #14006) measured no gain. Convolutions and matrix products run as tiled
GEMMs (cuDNN's implicit GEMM): what fills the device is the number of thread blocks.

The model ("fill model"), for ``aten.convolution``, each part of ``aten.convolution_backward``
and ``mm``/``addmm``/``bmm``:

* the kernel is a GEMM of M x N outputs over a reduction of depth K, tiled ``TILE`` x
  ``TILE`` (128x128, one block per SM): ``blocks = ceil(M/TILE) * ceil(N/TILE) * groups``;
  conv forward: M = batch*out pixels, N = C_out/g, K = C_in/g*kh*kw; data gradient
  (dgrad): M = batch*in pixels, N = C_in/g, K = C_out/g*kh*kw; weight gradient (wgrad):
  M = C_out/g, N = C_in/g*kh*kw, K = batch*out pixels;
* a weight gradient has few output tiles but a deep reduction, so the library splits K
  (split-K): ``split = max(1, K // SPLIT_K_MIN)`` more blocks;
* ``utilization = min(1, blocks * split / slots)``, ``slots = SMs * BLOCKS_PER_SM``: a
  kernel with fewer blocks than the device has slots leaves the rest of the SMs idle for
  another stream's kernel;
* consistent with that, a roofline (Analytic) time assumes the whole device: a kernel that
  fills only ``u`` of it takes ``roofline / u`` (never less than the kernel floor).
  Measured (Profiled) times already include it and are left as they are, and so are the
  times of a spec fitted to measured kernels (``DeviceSpec.kernels_measured``).

Under processor sharing (``fxdream.sim.simulate.Contention``) two kernels of fill ``u_a``,
``u_b`` and lengths ``D <= W`` started together finish ``D * min(1, 2 - u_a - u_b)`` sooner
than one after the other: all of the shorter one is hidden while the device has room
(``u_a + u_b <= 1``), none of it when both fill the device. Small batches give small
``u`` (gain), large batches ``u = 1`` (no gain): that is the batch-size crossover
``fxdream.explain.crossover`` computes. Tail effects of multi-wave kernels are not
modelled (a conservative choice: they would add some gain at large batch).

``OccupancyAware(cost)`` wraps any cost model with this utilization (and the roofline
correction for analytic costs); it also gives the stream-ordering nodes of
``fxdream.streams`` the device's smallest-kernel time on their stream (a cross-stream
wait/record costs about an empty kernel there) instead of a roofline or a host timing.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxdream.ir.flops import kernel_class, kernel_count
from fxdream.ir.nodes import is_view, node_bytes, node_dtype, op_name, value_of
from fxdream.ir.tensors import tensor_bytes
from fxdream.runtime.streams import OnStream, is_event_node
from fxdream.sim.cost.analytic import Analytic

TILE = 128
BLOCKS_PER_SM = 1
SPLIT_K_MIN = 1024
EVENT_UTILIZATION = 0.05
EVENT_HOST_US = 3.0          # host time of one record_event / wait_event call (estimate)
STREAM_SWITCH_HOST_US = 4.0  # extra host time of an OnStream call over its op (estimate)


@dataclass(frozen=True)
class Gemm:
    """One GEMM-like kernel: ``M x N`` outputs, reduction depth ``K``, ``groups`` of them;
    ``split_k``: the reduction may be split across blocks (weight gradients)."""
    kind: str        # "fwd" | "dgrad" | "wgrad" | "mm"
    m: int
    n: int
    k: int
    groups: int = 1
    split_k: bool = False

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.groups

    def split(self) -> int:
        return max(1, self.k // SPLIT_K_MIN) if self.split_k else 1

    def blocks(self) -> int:
        return math.ceil(self.m / TILE) * math.ceil(self.n / TILE) * self.groups * self.split()

    def fill(self, num_sms: int) -> float:
        return min(1.0, self.blocks() / (num_sms * BLOCKS_PER_SM))

    def workspace_bytes(self) -> int:
        """Split-K partial sums (float32) beyond the output itself."""
        return (self.split() - 1) * self.m * self.n * self.groups * 4



def _shape(arg):
    value = value_of(arg)
    return tuple(int(s) for s in value.shape) if isinstance(value, torch.Tensor) else None


def _prod(xs) -> int:
    return math.prod(xs) if xs else 1


def conv_gemms(out_shape, in_shape, weight_shape, groups: int, mask=(True, True, False)) -> list[Gemm]:
    """GEMMs of a convolution's backward: dgrad (mask[0]) and wgrad (mask[1]); bias is a reduction."""
    batch, c_in, in_pix = in_shape[0], in_shape[1], _prod(in_shape[2:])
    c_out, out_pix = out_shape[1], _prod(out_shape[2:])
    window = _prod(weight_shape[2:])
    g = max(1, int(groups))
    gemms = []
    if mask[0]:
        gemms.append(Gemm("dgrad", batch * in_pix, c_in // g, c_out // g * window, g))
    if mask[1]:
        gemms.append(Gemm("wgrad", c_out // g, c_in // g * window, batch * out_pix, g, split_k=True))
    return gemms


def gemms_of(node: fx.Node) -> list[Gemm] | None:
    """The GEMM-like kernels a node launches, or None when it is not one (or shapes are unknown)."""
    if node.op != "call_function":
        return None
    name = op_name(node)
    args = node.args
    try:
        if name == "aten.convolution_backward":
            grad, x, w = (_shape(a) for a in args[:3])
            if None in (grad, x, w) or len(x) < 3:
                return None
            return conv_gemms(grad, x, w, args[9], tuple(args[10])) or None
        if name == "aten.convolution":
            x, w, out = _shape(args[0]), _shape(args[1]), _shape(node)
            if None in (x, w, out) or len(x) < 3:
                return None
            g = max(1, int(args[8]))
            return [Gemm("fwd", out[0] * _prod(out[2:]), out[1] // g, x[1] // g * _prod(w[2:]), g)]
        if name in ("aten.mm", "aten.addmm"):
            a, b = (_shape(t) for t in (args[-2], args[-1]))
            if a is None or b is None:
                return None
            return [Gemm("mm", a[0], b[1], a[1])]
        if name == "aten.bmm":
            a, b = _shape(args[0]), _shape(args[1])
            if a is None or b is None:
                return None
            return [Gemm("mm", a[1], b[2], a[2], a[0])]
    except (TypeError, IndexError, ValueError):
        return None
    return None


def occupancy(node: fx.Node, num_sms: int) -> float | None:
    """Time-weighted fill of a node's GEMM kernels (see module docstring), None if not GEMM-like.

    A node with several kernels (a convolution_backward computing dgrad and wgrad) runs them
    one after the other: its average fill is total work over the sum of work/fill."""
    gemms = gemms_of(node)
    if not gemms or not num_sms:
        return None
    total = sum(g.flops for g in gemms)
    if total <= 0:
        return None
    return total / sum(g.flops / g.fill(num_sms) for g in gemms)


class OccupancyAware:
    """A cost model whose GEMM kernels follow the fill model (module docstring).

    With a roofline base whose kernel costs do not already contain the fill (``Analytic`` on a
    spec without ``kernels_measured``; ``inflate`` says so), a ``convolution_backward`` is its
    separate kernels, each its startup plus its own roofline over the tensors it really reads
    (dgrad: grad_output, weight, grad_input; wgrad: grad_output, input, grad_weight; bias:
    grad_output) divided by its fill, floored at the smallest kernel, then summed: one fused
    node and its split parts cost alike (and launch alike: one launch per kernel). Other
    GEMM-like nodes: roofline / fill. Float32 convolutions run at the TF32 rate where the
    device has one and cuDNN may use it (``tf32_conv``, default
    ``torch.backends.cudnn.allow_tf32``, True in PyTorch). Measured (Profiled) times, and
    those of a spec fitted to measured kernels, are kept as they are.

    Stream-ordering nodes (``fxdream.streams``): ``EVENT_HOST_US`` of host time and the
    smallest kernel on their stream; an ``OnStream`` node ``STREAM_SWITCH_HOST_US`` more
    host time than its op (stream switch, record_stream). Both are estimates, to be replaced
    by the per-call overheads ``benchmarks/gpu_aux_stream.py`` measures.

    ``workspace_bytes(node)``: a split-K weight gradient's partial sums (``(split - 1) * M *
    N * groups`` float32), alive while the kernel runs.
    """
    occupancy_aware = True

    def __init__(self, base, inflate: bool | None = None, tf32_conv: bool | None = None):
        self.base = base
        self.device = base.device
        fill_in_costs = isinstance(base, Analytic) and not base.device.kernels_measured
        self.inflate = fill_in_costs if inflate is None else inflate
        self.tf32_conv = torch.backends.cudnn.allow_tf32 if tf32_conv is None else tf32_conv
        self.tf32_matmul = torch.backends.cuda.matmul.allow_tf32

    # --- kernels ----------------------------------------------------------------------------
    def kernel_us(self, node: fx.Node) -> float:
        if is_event_node(node):
            return self.device.kernel_min_us if self.device.kind != "cpu" else 0.0
        if not self.inflate or is_view(node) or self.device.kind == "cpu":
            return self.base.kernel_us(node)
        gemms = gemms_of(node)
        if not gemms:
            return self.base.kernel_us(node)
        sms = self.device.num_sms or 0
        floor = self.device.kernel_min_us
        name = op_name(node)
        startup = self.device.kernel_startup_us.get(kernel_class(node), 0.0)
        if name == "aten.convolution_backward":
            return sum(max(floor, startup + self._roofline(node, g.flops, b) / g.fill(sms))
                       for g, b in zip(gemms, _conv_bw_bytes(node, gemms))) + self.bias_gradient_us(node)
        if name == "aten.convolution":
            return max(floor, startup + self._roofline(node, gemms[0].flops, node_bytes(node)) / gemms[0].fill(sms))
        t = self.base.kernel_us(node)
        return t if t <= floor else max(floor, t / (occupancy(node, sms) or 1.0))

    def peak_flops(self, node: fx.Node) -> float:
        """FLOP/s of a GEMM-like node at the rate it computes at (``DeviceSpec.math_dtype``: TF32
        for float32 convolutions unless torch.backends.cudnn.allow_tf32 is off, for float32
        matrix products where torch.backends.cuda.matmul.allow_tf32 is on)."""
        return self.device.flops(self.device.math_dtype(node_dtype(node), kernel_class(node), self.tf32_conv,
                                                        self.tf32_matmul))

    def _roofline(self, node: fx.Node, flops: float, nbytes: float) -> float:
        seconds = max(flops / self.peak_flops(node), nbytes / self.device.mem_bandwidth)
        return seconds * 1e6 / self.device.share(kernel_class(node))

    def bias_gradient_us(self, node: fx.Node) -> float:
        """The bias-gradient kernel of a ``convolution_backward`` (a reduction of grad_output over
        all but the channel dimension, memory-bound); 0 when the node computes none."""
        if op_name(node) != "aten.convolution_backward" or len(node.args) != 11:
            return 0.0
        mask = node.args[10]
        if not mask[2]:
            return 0.0
        grad = value_of(node.args[0])
        nbytes = tensor_bytes(grad) if isinstance(grad, torch.Tensor) else 0
        return self.device.kernel_time_us(0, nbytes)

    def dispatch_us(self, node: fx.Node) -> float:
        """A convolution_backward launches one kernel per gradient it computes (dgrad, wgrad,
        bias): one launch each, so a fused call and its split parts launch alike."""
        if self.device.kind == "cpu":
            return self.base.dispatch_us(node)
        if is_event_node(node):
            return EVENT_HOST_US
        extra = STREAM_SWITCH_HOST_US if isinstance(node.target, OnStream) else 0.0
        extra += (kernel_count(node) - 1) * self.device.launch_overhead_us
        return self.base.dispatch_us(node) + extra

    def graph_call_us(self) -> float:
        return self.base.graph_call_us() if hasattr(self.base, "graph_call_us") else 0.0

    def utilization(self, node: fx.Node) -> float:
        if is_event_node(node):
            return EVENT_UTILIZATION
        u = occupancy(node, self.device.num_sms or 0) if self.device.kind != "cpu" else None
        if u is not None:
            return max(EVENT_UTILIZATION, u)
        base = getattr(self.base, "utilization", None)
        return base(node) if base is not None else 1.0

    def workspace_bytes(self, node: fx.Node) -> int:
        if self.device.kind == "cpu":
            return 0
        return sum(g.workspace_bytes() for g in gemms_of(node) or ())

    def __getattr__(self, name):  # profiling helpers etc. of the wrapped model
        if name == "base":
            raise AttributeError(name)
        return getattr(self.base, name)


def _conv_bw_bytes(node: fx.Node, gemms: list[Gemm]) -> list[int]:
    """Bytes each part of a convolution_backward moves: dgrad reads grad_output and weight and
    writes an input-sized gradient, wgrad reads grad_output and input and writes a
    weight-sized one: both move grad_output + input + weight bytes."""
    grad, x, w = (tensor_bytes(value_of(a)) for a in node.args[:3])
    return [grad + x + w for _ in gemms]


def occupancy_aware(cost):
    """``cost`` itself if it already models occupancy, else ``OccupancyAware(cost)``; None stays None."""
    if cost is None or getattr(cost, "occupancy_aware", False):
        return cost
    return OccupancyAware(cost)
