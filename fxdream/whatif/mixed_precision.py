"""AMP what-if: the training step under ``torch.autocast`` in float16 or bfloat16.

Kernels of convolution/matmul ops (``COMPUTE_OPS``) are re-derived with the roofline at the
DeviceSpec's fp16/bf16 rate with float32 tensors at 2 bytes; other kernels keep their FLOP rate
and halve their bytes; ops autocast keeps in float32 (``FP32_OPS``) and the optimizer (fp32
master weights) are unchanged.  The scenario's kernel is the baseline's (measured or analytic)
duration times the roofline ratio new/old, so profiled baselines keep their measured
inefficiencies.  Each forward matmul-like op also pays autocast's casts of its float32 graph
inputs (weights, bias, the model's input: read 4 + write 2 bytes per element at memory
bandwidth, once per iteration, folded into its kernel; the casts' own launches and their
backward are not modelled).  Without FX nodes: compute ops scale by the fp32/fp16 peak ratio
(compute-bound assumption), others by 0.5, never below the device's shortest kernel.

On a CPU device each op is instead micro-benchmarked here in float32 and in the low dtype at
its shapes, and the ratio scales its profiled time (``measure``); without FX nodes the
DeviceSpec's rate, measured here with one matmul when it has none, is used (on CPUs without
bf16 units far below fp32).
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Mapping

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from fxdream.ir.flops import node_flops
from fxdream.ir.nodes import VIEW_OPS, value_of
from fxdream.ir.tensors import real_tensors
from fxdream.sim.cost.devices import DeviceSpec, dtype_name
from fxdream.sim.profile.host_timing import _time_calls
from fxdream.sim.profile.in_context import random_like
from fxdream.sim.profile.op_keys import profile_key
from fxdream.sim.taskgraph import Task, TaskKind
from fxdream.whatif.core import (
    _UNSPECIFIED,
    WhatIf,
    _finish,
    _graphs_by_label,
    _spec,
    _start,
    _through_views,
    _with_durations,
    graph_label,
)

# ops that autocast runs in fp16/bf16 on tensor cores: re-derived at the low-precision rate
COMPUTE_OPS = frozenset({
    "aten.convolution", "aten.convolution_backward", "aten._convolution", "aten.mm",
    "aten.addmm", "aten.bmm", "aten.baddbmm", "aten.matmul", "aten.linear",
    "aten._scaled_dot_product_flash_attention", "aten._scaled_dot_product_efficient_attention",
    "aten._scaled_dot_product_cudnn_attention",
    "aten._scaled_dot_product_flash_attention_backward",
    "aten._scaled_dot_product_efficient_attention_backward",
})
# ops autocast keeps in float32 (a subset of its "fp32" list that appears in ATen graphs)
FP32_OPS = frozenset({
    "aten._softmax", "aten._log_softmax", "aten._softmax_backward_data",
    "aten._log_softmax_backward_data", "aten.native_layer_norm",
    "aten.native_layer_norm_backward", "aten.native_group_norm",
    "aten.native_group_norm_backward", "aten.nll_loss_forward", "aten.nll_loss_backward",
    "aten.exp", "aten.log", "aten.pow", "aten.sum", "aten.prod", "aten.cumsum",
    "aten.norm", "aten.linalg_vector_norm", "aten.mse_loss", "aten.binary_cross_entropy",
})
_NON_KERNEL_OPS = VIEW_OPS | {"getitem", "graph_call"}

_DTYPES = {"float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
           "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
_CPU_RATES: dict[str, float] = {}   # cpu_flops: "dtype|threads|n" -> FLOP/s


def _is_compute_op(op: str) -> bool:
    return op in COMPUTE_OPS or "convolution" in op


def _node_of(task: Task, by_label: Mapping[str, fx.GraphModule], cache: dict) -> fx.Node | None:
    """The FX node a lowered task came from (its name is "<label>:<node>[:k]")."""
    if task.fx_node is None:
        return None
    label = graph_label(task.name.split(":", 1)[0])  # each call of a graph called more than once
    gm = by_label.get(label)
    if gm is None:
        return None
    if label not in cache:
        cache[label] = {n.name: n for n in gm.graph.nodes}
    return cache[label].get(task.fx_node)


def _is_kernel(t: Task, on_gpu: bool) -> bool:
    """A task doing an op's work: a GPU kernel, or (CPU device) an op's host task; no views."""
    if t.op in _NON_KERNEL_OPS or t.phase == "comm":
        return False
    if on_gpu:
        return t.kind is TaskKind.GPU
    return t.kind is TaskKind.CPU and t.fx_node is not None


def cpu_flops(dtype: torch.dtype, n: int = 256, seconds: float = 0.2) -> float:
    """This CPU's matmul FLOP/s in ``dtype`` (best of repeated n×n mm, on the current threads)."""
    key = f"{dtype}|{torch.get_num_threads()}|{n}"
    if key not in _CPU_RATES:
        a, b = torch.randn(n, n).to(dtype), torch.randn(n, n).to(dtype)
        torch.mm(a, b)
        best, deadline, reps = math.inf, time.perf_counter() + seconds, 0
        while reps < 3 or time.perf_counter() < deadline:
            t0 = time.perf_counter()
            torch.mm(a, b)
            best = min(best, time.perf_counter() - t0)
            reps += 1
        _CPU_RATES[key] = 2 * n ** 3 / best
    return _CPU_RATES[key]


def _amp_spec(spec: DeviceSpec, dtype: str) -> DeviceSpec:
    """The DeviceSpec with a rate for ``dtype``; a CPU without one gets it measured here."""
    if dtype in spec.peak_flops or spec.kind != "cpu":
        return spec
    fp32 = cpu_flops(torch.float32)
    low = cpu_flops(_DTYPES[dtype])
    rate = spec.peak_flops["float32"] * low / fp32  # the calibrated fp32 peak, scaled by the ratio
    return dataclasses.replace(spec, peak_flops={**spec.peak_flops, dtype: rate})



def _bytes(node: fx.Node, half: bool) -> float:
    """Bytes the kernel reads and writes; with ``half`` every float32 tensor counts 2 bytes."""
    leaves = tree_flatten(tree_map(value_of, (node.args, node.kwargs)))[0] + tree_flatten(node.meta.get("val"))[0]
    total = 0.0
    for t in leaves:
        if isinstance(t, torch.Tensor):
            size = t.element_size()
            if half and t.dtype == torch.float32:
                size = 2
            total += t.numel() * size
    return total



def _cast_elements(node: fx.Node, seen: set) -> int:
    """Elements autocast casts to low precision for a forward matmul-like op: its float32
    graph inputs (parameters, the model's input), each once per iteration (autocast caches)."""
    count = 0
    for a in node.all_input_nodes:
        base = _through_views(a)
        if base.op != "placeholder" or base in seen:
            continue
        v = base.meta.get("val")
        if isinstance(v, torch.Tensor) and v.dtype == torch.float32:
            seen.add(base)
            count += v.numel()
    return count


def _measured_ratio(node: fx.Node, dtype: torch.dtype, cache: dict) -> float | None:
    """time(op with its float32 tensors in ``dtype``) / time(op in float32), both micro-
    benchmarked here at the node's shapes; None if the op does not run that way."""
    # cost.py's private helpers (materialise fake tensors, time blocks of calls): isolated here
    key = (profile_key(node, "cpu"), str(dtype))
    if key in cache:
        return cache[key]
    ratio = None
    if callable(node.target):
        try:
            with real_tensors():
                cpu = torch.device("cpu")
                args, kwargs = tree_map(lambda v: random_like(v, cpu), tree_map(value_of, (node.args, node.kwargs)))
                low = tree_map(lambda t: t.to(dtype) if isinstance(t, torch.Tensor)
                               and t.dtype == torch.float32 else t, (args, kwargs))
                t32 = _time_calls(lambda: node.target(*args, **kwargs), rounds=3, target_block_us=1000.0)
                t16 = _time_calls(lambda: node.target(*low[0], **low[1]), rounds=3, target_block_us=1000.0)
            ratio = t16 / t32 if t32 > 0 else None
        except Exception:  # an op that rejects mixed dtypes: the roofline ratio stands
            ratio = None
    cache[key] = ratio
    return ratio


def amp(x, device=None, dtype: str = "float16", *, captured=None, graphs=None,
        measure: bool | None = None, contention: bool | None = None) -> WhatIf:
    """What if the model ran under autocast (AMP) in ``dtype`` ("float16" or "bfloat16")?

    Kernels of ``COMPUTE_OPS`` at the DeviceSpec's ``dtype`` rate, other kernels with half
    the bytes (module docstring).  ``device`` defaults to the prediction's.  ``measure``
    (default: on a CPU device with ``captured``): each op's ratio low/fp32 is micro-benchmarked
    here at its shapes instead of derived from the roofline (a CPU's bf16 speed depends on
    the op and shape far more than one matmul rate says)."""
    s = _start(x, device, captured, graphs, contention)
    key = dtype_name(dtype)
    if key not in ("float16", "bfloat16"):
        raise ValueError(f"dtype={dtype!r} is not an AMP dtype; valid: 'float16', 'bfloat16'")
    base_spec = _spec(device) or s.current.device
    if base_spec is _UNSPECIFIED:
        raise ValueError("amp needs a device (a DeviceSpec or a name such as 'h100') for its rates")
    if base_spec.kind == "cuda" and key == "bfloat16" and "bfloat16" not in base_spec.peak_flops:
        raise ValueError(f"{base_spec.name} has no bfloat16 math (torch's autocast refuses bfloat16 on such a GPU): "
                         f"use dtype='float16'")
    spec = _amp_spec(base_spec, key)
    on_gpu = spec.kind != "cpu"
    p32, plow, bw = spec.flops("float32"), spec.flops(key), spec.mem_bandwidth
    kmin = spec.kernel_min_us
    dispatch = 0.0 if on_gpu else spec.dispatch_overhead_us
    by_label, cache, seen = _graphs_by_label(s.captured, s.graphs), {}, set()
    measure = (not on_gpu and bool(by_label)) if measure is None else measure
    if measure and on_gpu:
        raise ValueError("amp(measure=True) micro-benchmarks on this CPU: only for a CPU device")
    timed: dict = {}
    tg = s.current.task_graph
    new: dict[str, float] = {}
    counts = dict(compute=0, elementwise=0, fp32=0, from_fx=0, measured=0, weight_cast_MB=0.0)
    for t in tg.tasks:
        if t.phase == "optim" or not _is_kernel(t, on_gpu):
            continue
        compute = _is_compute_op(t.op)
        if not compute and t.op in FP32_OPS:
            counts["fp32"] += 1
            continue
        counts["compute" if compute else "elementwise"] += 1
        kernel = max(t.duration_us - dispatch, 0.0)
        node = _node_of(t, by_label, cache)
        if node is not None:
            counts["from_fx"] += 1
            flops = node_flops(node)
            old = max(flops / p32, _bytes(node, False) / bw) * 1e6
            # autocast's casts of float32 inputs: read 4 + write 2 bytes per element
            cast = 6 * _cast_elements(node, seen) if compute and t.phase == "fw" else 0
            counts["weight_cast_MB"] += cast / 1e6
            newk = max(flops / (plow if compute else p32), (_bytes(node, True) + cast) / bw) * 1e6
            old, newk = max(old, kmin), max(newk, kmin)
            ratio = newk / old if old > 0 else 1.0
            measured = _measured_ratio(node, _DTYPES[key], timed) if measure else None
            if measured is not None:
                counts["measured"] += 1
                ratio = measured + (cast / bw * 1e6 / kernel if kernel > 0 else 0.0)
        else:  # no FX node (a hand-built graph): ratios only
            ratio = p32 / plow if compute else 0.5
        scaled = kernel * ratio
        if on_gpu and kernel >= kmin:
            scaled = max(scaled, kmin)
        new[t.name] = dispatch + scaled if not on_gpu else scaled
    counts["weight_cast_MB"] = round(counts["weight_cast_MB"], 3)
    details = {f"amp.{k}": v for k, v in counts.items()}
    details["amp.rates"] = f"{key} {plow / 1e12:.4g} TFLOP/s vs float32 {p32 / 1e12:.4g} TFLOP/s" + \
        (" (ratios measured per op here)" if measure else "")
    return _finish(s, f"AMP {key}", _with_durations(tg, new), details)
