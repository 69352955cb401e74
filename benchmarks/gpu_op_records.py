"""The per-op records of a GPU lease (``benchmarks/gpu_op_profile.py``) as fit cases: each
record's kernel time against the kernel model of a DeviceSpec, each kernel class's startup and
share where its own records put them, and each class's host cost over a pointwise op's.
Used by ``benchmarks/fit_gpu_model.py``."""
from __future__ import annotations

import dataclasses
import json
import math
import re
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from fxdream.ir.flops import pointwise_weight_shape, traffic_factor
from fxdream.sim.cost.devices import DeviceSpec


@dataclass(frozen=True)
class Case:
    """One measured time and how to predict it from a DeviceSpec."""
    name: str
    measured_ms: float
    predict_ms: Callable[[DeviceSpec], float]
    source: str
    group: str = "model"  # "model" (a whole step), or a per-op "kernel" / "host" time
    op: str = ""          # the op of a per-op case
    kernel_class: str = ""  # and its kernel class


# (cuDNN, matmul) TF32 flags the per-op records ran with: PyTorch's defaults, which
# gpu_op_profile.py leaves as they are. A float32 convolution ran on TF32 tensor cores.
RECORDED_TF32 = (True, False)


def op_records(paths: list[str]) -> dict[str, list[dict]]:
    """Each ``gpu_op_profile.py`` file's records, by file name, read once, each in the kernel
    class ``fxdream.ir.flops.kernel_class`` gives its op now (``record_class``)."""
    return {Path(p).name: [dict(r, **{"class": record_class(r)}) for r in json.loads(Path(p).read_text())["records"]]
            for p in paths}


def record_class(record: dict) -> str:
    """A record's kernel class, with a convolution whose weight (its key's third tensor for a
    backward, second for the others) has a 1-wide kernel in every spatial dimension in
    "conv_1x1": records written before that class existed say "conv"."""
    if record["class"] != "conv":
        return record["class"]
    tensors = key_tensors(record)
    position = 2 if record["op"] == "aten.convolution_backward" else 1
    return "conv_1x1" if len(tensors) > position and pointwise_weight_shape(tensors[position][0]) else "conv"


def key_tensors(record: dict) -> list[tuple[list[int], str]]:
    """(shape, dtype name) of each tensor argument in a record's op key, in argument order."""
    return [([int(d) for d in shape.split(",") if d.strip()], dtype)
            for shape, dtype in re.findall(r"T\(([^)]*)\):(\w+):", record["key"])]


def record_kernels(record: dict) -> int:
    """Kernels one record's op launched: a convolution_backward one per gradient in its output
    mask (the key's last three fields), any other op one (``fxdream.ir.flops.kernel_count``)."""
    if record["op"] != "aten.convolution_backward":
        return 1
    return max(1, record["key"].rsplit(",", 3)[1:].count("True"))


def record_kernel_us(record: dict) -> float | None:
    """The kernel time a record measured: replayed in a CUDA graph where it was (the stream time
    the floor stands for), before the recording spec's floor where the record keeps that
    (``in_graph_unfloored_us``: a fit of the floor must not read its own value back), else timed
    alone."""
    unfloored = record.get("in_graph_unfloored_us")
    if unfloored is not None and unfloored > 0:
        return unfloored
    return record.get("in_graph_us") or record["kernel_us"]


def record_traffic(record: dict) -> float:
    """A record's memory traffic as ``fxdream.ir.flops.kernel_bytes`` counts it for the node:
    its tensors' bytes times ``traffic_factor``, and for a convolution_backward the first three
    tensors of its key (grad_output, input, weight) read again by each kernel after the first."""
    traffic = record["bytes"] * traffic_factor(record["op"], record["dtype"])
    if record["op"] == "aten.convolution_backward":
        read = sum(math.prod(shape) * getattr(torch, dtype).itemsize for shape, dtype in key_tensors(record)[:3])
        traffic += (record_kernels(record) - 1) * read
    return traffic


def record_roofline_us(spec: DeviceSpec, record: dict) -> float:
    """A record's kernel time on ``spec``'s roofline, its math at the rate it ran at."""
    dtype = spec.math_dtype(record["dtype"], record["class"], *RECORDED_TF32)
    traffic = record_traffic(record)
    return spec.kernel_time_us(record["flops"], traffic, dtype, record["class"], record_kernels(record))


# A class's share of the roofline is read from its long kernels, where the startup is a small
# part of the time: a class with fewer than LONG_KERNELS records of at least LONG_KERNEL_US of
# roofline time keeps the datasheet's share (ResNet-50's GEMMs, its one small linear layer).
LONG_KERNEL_US = 10.0
LONG_KERNELS = 5


def long_kernel_counts(spec: DeviceSpec, records: list[dict]) -> dict[str, int]:
    """Per kernel class, the records of at least ``LONG_KERNEL_US`` of roofline time."""
    bare = dataclasses.replace(spec, kernel_min_us=0.0, roofline_share={}, kernel_startup_us={})
    counts: dict[str, int] = {}
    for r in records:
        if record_kernel_us(r) and record_roofline_us(bare, r) >= LONG_KERNEL_US:
            counts[r["class"]] = counts.get(r["class"], 0) + 1
    return counts


def borrowed_classes(spec: DeviceSpec, fit_records: list[dict], held_records: list[dict]) -> dict[str, str]:
    """Kernel classes whose share the fit model's records cannot set (under ``LONG_KERNELS``
    long kernels) and the held-out model's can: class → why the held-out records of it are used. Without
    them such a class keeps the datasheet's 100 % of the roofline, which no measured kernel reaches
    (BERT's long GEMMs ran at 58-73 % of an H200's peak)."""
    fit, held = long_kernel_counts(spec, fit_records), long_kernel_counts(spec, held_records)
    return {c: f"{fit.get(c, 0)} long kernel(s) of this class in the fit model's records, {n} in the held-out "
               f"model's: the held-out model's records of this class set its startup and share with the fit "
               f"model's (per_op_borrowed), and are not checked"
            for c, n in sorted(held.items()) if fit.get(c, 0) < LONG_KERNELS <= n}


def class_kernel_models(spec: DeviceSpec, records: list[dict]) -> dict[str, float]:
    """For each kernel class in ``records``, the startup per kernel and the share of the
    roofline that best fit its kernel times (least mean |log error| over a grid; the share
    only where the class has long kernels), the floor staying ``spec``'s."""
    bare = dataclasses.replace(spec, kernel_min_us=0.0, roofline_share={}, kernel_startup_us={})
    by_class: dict[str, list[tuple[float, int, float]]] = {}
    for r in records:
        if record_kernel_us(r):
            by_class.setdefault(r["class"], []).append((record_roofline_us(bare, r), record_kernels(r),
                                                        record_kernel_us(r)))
    values = {}
    for kernel_class, rows in sorted(by_class.items()):
        roofline, kernels, measured = (torch.tensor(column, dtype=torch.float64) for column in zip(*rows))
        long_kernels = int((roofline >= LONG_KERNEL_US).sum())
        shares = torch.logspace(-1.7, 0.0, 80) if long_kernels >= LONG_KERNELS else torch.ones(1)
        startups = torch.linspace(0.0, 30.0, 121)
        predicted = torch.maximum(startups[:, None, None] * kernels + roofline / shares[None, :, None],
                                  spec.kernel_min_us * kernels)
        best = int((predicted / measured).log().abs().mean(-1).argmin())
        values[f"kernel_startup_us.{kernel_class}"] = float(startups[best // len(shares)])
        if len(shares) > 1:
            values[f"roofline_share.{kernel_class}"] = float(shares[best % len(shares)])
    return values


def op_cases(source: str, records: list[dict]) -> list[Case]:
    """Per-op cases from the records of one ``gpu_op_profile.py`` file (``source``): each kernel
    time (``record_kernel_us``) against the kernel model of its FLOPs, bytes, dtype, class and
    kernel count; each host time against dispatch + launch."""
    cases = []
    for r in records:
        kernel_us = record_kernel_us(r)
        if kernel_us and kernel_us > 0:
            cases.append(Case(f"{r['case']}: {r['op']} kernel", kernel_us / 1e3,
                              lambda spec, r=r: record_roofline_us(spec, r) / 1e3, source, "kernel", r["op"],
                              r["class"]))
        if r.get("host_us"):
            cases.append(Case(f"{r['case']}: {r['op']} host", r["host_us"] / 1e3,
                              lambda spec, r=r: spec.host_us(r["class"]) / 1e3, source,
                              "host", r["op"], r["class"]))
    return cases


def host_factors(records: list[dict], held_out: tuple[str, ...]) -> dict[str, float]:
    """``host_factor.<class>``: each kernel class's median host µs per op over that of class
    "other" (pointwise ops), from the records of the models not held out."""
    by_class: dict[str, list[float]] = {}
    for r in records:
        if r.get("host_us") and not r["case"].startswith(held_out):
            by_class.setdefault(r["class"], []).append(r["host_us"])
    if "other" not in by_class:
        return {}
    other = statistics.median(by_class["other"])
    return {f"host_factor.{c}": round(statistics.median(v) / other, 3) for c, v in sorted(by_class.items())
            if c != "other"}
