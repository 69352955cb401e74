"""``Analytic(DeviceSpec)``: a roofline, max(FLOPs / peak, traffic / bandwidth) over the share of
it the kernel's class reaches, plus the class's startup per kernel, floored at the device's
smallest kernel, plus a fixed dispatch/launch cost per op (traffic: ``kernel_bytes``). It
predicts for any GPU from its datasheet, or from the overheads, startups and shares fitted to
measurements (``DeviceSpec.source``, ``fxdream/sim/cost/fits``).

A ``getitem`` is Python indexing the tuple an op returned: no dispatch, no kernel."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fxdream.ir.flops import (
    kernel_bytes,
    kernel_class,
    kernel_count,
    node_flops,
    rnn_kernel_launches,
    rnn_sequential_steps,
)
from fxdream.ir.nodes import is_view, node_dtype
from fxdream.sim.cost.devices import DeviceSpec


class Analytic:
    """Roofline costs from a DeviceSpec (a what-if changes the spec, e.g. one dtype's peak).
    Float32 convolutions and GEMMs run at the TF32 rate where torch's flags allow it
    (``DeviceSpec.math_dtype``), read when the model is made."""

    def __init__(self, device: DeviceSpec):
        self.device = device
        self.tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32

    def kernel_us(self, node: fx.Node) -> float:
        if is_view(node):
            return 0.0
        klass = kernel_class(node)
        dtype = self.device.math_dtype(node_dtype(node), klass, *self.tf32)
        roofline_us = self.device.kernel_time_us(node_flops(node), kernel_bytes(node), dtype, klass, kernel_count(node))
        # a recurrence runs its steps in sequence: at least a GEMM and a pointwise kernel each
        sequential = 2 * rnn_sequential_steps(node) * self.device.kernel_min_us
        return max(roofline_us, sequential)

    def dispatch_us(self, node: fx.Node) -> float:
        if node.target is operator.getitem:
            return 0.0
        if is_view(node) or self.device.kind == "cpu":
            return self.device.dispatch_overhead_us  # no kernel launched
        # an RNN op launches kernels step by step (a launch each); any other op, one
        extra_launches = max(rnn_kernel_launches(node) - 1, 0)
        return self.device.host_us(kernel_class(node)) + extra_launches * self.device.launch_overhead_us

    def graph_call_us(self) -> float:
        # an estimate: guard checks and wrappers cost a few framework dispatches
        return 4 * self.device.dispatch_overhead_us

    def utilization(self, node: fx.Node) -> float:
        """Share of the GPU one kernel can fill: output elements over resident threads (≈2048 per SM)."""
        if self.device.kind == "cpu" or not self.device.num_sms:
            return 1.0
        leaves, _ = tree_flatten(node.meta.get("val"))
        elements = sum(t.numel() for t in leaves if isinstance(t, torch.Tensor))
        return min(1.0, max(0.05, elements / (self.device.num_sms * 2048)))
