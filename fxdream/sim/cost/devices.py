"""Device specs for the analytic cost model: datasheet GPUs and a calibrated host CPU.

GPU figures are dense (no 2:4 sparsity) peaks from NVIDIA's public datasheets; ``float32`` is
the non-tensor-core FP32 rate, ``tf32``/``float16``/``bfloat16`` the tensor-core rates; memory
sizes take the datasheet's "GB" as GiB (HBM stacks are binary sizes).  The overhead fields are
on no datasheet; they come from an H100 SXM machine (PyTorch 2.11, CUDA 13), where a 1-element
``torch.add`` costs 1.5 µs of CPU on CPU tensors (dispatch) and 6.6 µs on CUDA tensors, so
launching costs ~5 µs more; a tiny kernel replayed in a CUDA graph takes 1.2 µs of GPU time.
Hopper entries use these; V100/A100 use the same host costs and a longer floor (estimates).
Replace them by calibration/profiling when it matters.
"""
from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

GiB = 2 ** 30


@dataclass(frozen=True)
class DeviceSpec:
    """What the analytic cost model needs to know about a device."""
    name: str
    kind: str                        # "cpu" | "cuda"
    peak_flops: Mapping[str, float]  # dtype name ("float32", "tf32", ...) -> FLOP/s
    mem_bandwidth: float             # bytes/s
    launch_overhead_us: float        # CPU time to launch one kernel (0 on cpu: no launch)
    dispatch_overhead_us: float      # framework dispatch per op, on the CPU
    kernel_min_us: float             # shortest kernel the device runs
    num_sms: int | None
    memory_bytes: int

    def __post_init__(self):
        if self.kind not in ("cpu", "cuda"):
            raise ValueError(f"DeviceSpec.kind must be 'cpu' or 'cuda', got {self.kind!r}")
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))

    def flops(self, dtype="float32") -> float:
        """Peak FLOP/s for ``dtype`` (a torch.dtype or its name); a dtype without its own entry
        (bf16 on V100, anything on a CPU calibrated in fp32) falls back to float32."""
        key = str(dtype).removeprefix("torch.")
        key = {"float": "float32", "half": "float16", "bf16": "bfloat16",
               "fp32": "float32", "fp16": "float16"}.get(key, key)
        return self.peak_flops.get(key) or self.peak_flops["float32"]

    def kernel_time_us(self, flops: float, bytes_moved: float, dtype="float32") -> float:
        """Roofline time of one kernel: max(compute, memory), at least ``kernel_min_us``."""
        t = max(flops / self.flops(dtype), bytes_moved / self.mem_bandwidth) * 1e6
        return max(t, self.kernel_min_us)


def _gpu(name, fp32, tf32, fp16, bf16, bw, sms, mem_gib, launch=5.0, dispatch=1.5, kmin=1.2):
    peaks = {"float32": fp32, "float16": fp16}
    if tf32:
        peaks["tf32"] = tf32
    if bf16:
        peaks["bfloat16"] = bf16
    return DeviceSpec(name, "cuda", peaks, bw, launch, dispatch, kmin, sms, mem_gib * GiB)


T = 1e12
_GPUS = {
    # NVIDIA Tesla V100 GPU Accelerator datasheet (SXM2 32 GB, 2018): FP32 15.7 TFLOPS,
    # Tensor (FP16) 125 TFLOPS, HBM2 900 GB/s, 32 GB; 80 SMs (Volta V100 whitepaper).  No
    # TF32/BF16 (bf16 falls back to fp32 in DeviceSpec.flops).
    "v100": _gpu("v100", 15.7 * T, None, 125 * T, None, 900e9, 80, 32, kmin=2.5),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80 GB, 2021): FP32 19.5, TF32 156,
    # BF16/FP16 312 TFLOPS (dense; 312/624 are the sparsity figures), HBM2e 2,039 GB/s,
    # 80 GB; 108 SMs (Ampere GA100 whitepaper).
    "a100": _gpu("a100", 19.5 * T, 156 * T, 312 * T, 312 * T, 2039e9, 108, 80, kmin=2.0),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM5 80 GB): FP32 67 TFLOPS; TF32 989,
    # BF16/FP16 1,979 TFLOPS are with sparsity -> dense 494.7 / 989.4 (Hopper whitepaper
    # table); HBM3 3.35 TB/s, 80 GB; 132 SMs.
    "h100": _gpu("h100", 67 * T, 494.7 * T, 989.4 * T, 989.4 * T, 3.35e12, 132, 80),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM, 2024): same compute as H100 SXM
    # (FP32 67, TF32 989*, BF16/FP16 1,979* TFLOPS, * = with sparsity -> halved), HBM3e
    # 4.8 TB/s, 141 GB; 132 SMs.
    "h200": _gpu("h200", 67 * T, 494.7 * T, 989.4 * T, 989.4 * T, 4.8e12, 132, 141),
}

_CPU_CACHE: dict[str, DeviceSpec] = {}  # the one global mutable: calibration, once per process


def calibrate_cpu(seconds: float = 0.1, *, refresh: bool = False) -> DeviceSpec:
    """Measure this host: fp32 matmul FLOP/s, copy bandwidth, per-op dispatch overhead.

    About ``seconds`` in total (split between the three), cached for the process unless
    ``refresh``.  Best-of-N timings: the peak is what the roofline needs.  The host's spec in
    ``DEVICES`` calls it when one of its numbers is first read (analytic costs, what-ifs);
    the default is short because a longer calibration gives the same peaks within a few %."""
    if "cpu" in _CPU_CACHE and not refresh:
        return _CPU_CACHE["cpu"]
    budget = max(0.05, float(seconds)) / 3

    def best(fn, min_reps=3):
        fn()  # warm-up
        t_end, reps, b = time.perf_counter() + budget, 0, float("inf")
        while reps < min_reps or time.perf_counter() < t_end:
            t0 = time.perf_counter()
            fn()
            b = min(b, time.perf_counter() - t0)
            reps += 1
        return b

    n = 512
    a, b_ = torch.randn(n, n), torch.randn(n, n)
    out = torch.empty(n, n)
    flops = 2 * n ** 3 / best(lambda: torch.mm(a, b_, out=out))
    src = torch.ones(64 * 2 ** 20 // 4)  # 64 MiB (x2 with dst): past most last-level caches
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 4 / best(lambda: dst.copy_(src))  # read + write
    x, y = torch.zeros(1), torch.zeros(1)
    k = 200

    def tiny():
        for _ in range(k):
            torch.add(x, y)
    dispatch_us = best(tiny) / k * 1e6
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 0
    spec = DeviceSpec("cpu", "cpu", {"float32": flops}, bw, launch_overhead_us=0.0,
                      dispatch_overhead_us=dispatch_us, kernel_min_us=0.0, num_sms=None,
                      memory_bytes=mem)
    _CPU_CACHE["cpu"] = spec
    return spec


class _CalibratedOnUse(DeviceSpec):
    """This host's spec, calibrated (``calibrate_cpu``) the first time one of its measured
    numbers is read. With measured costs no CPU build reads them (every op is timed), so a
    first build does not spend the calibration's time; analytic costs and what-ifs do."""

    def __new__(cls, *args, **kwargs):
        if args or kwargs:  # dataclasses.replace(spec, ...): a plain spec, with the numbers
            return DeviceSpec(*args, **kwargs)
        return object.__new__(cls)

    def __init__(self):
        for name, value in (("name", "cpu"), ("kind", "cpu"), ("launch_overhead_us", 0.0),
                            ("kernel_min_us", 0.0), ("num_sms", None)):
            object.__setattr__(self, name, value)


for _measured in ("peak_flops", "mem_bandwidth", "dispatch_overhead_us", "memory_bytes"):
    setattr(_CalibratedOnUse, _measured, property(lambda self, name=_measured: getattr(calibrate_cpu(), name)))
_HOST = _CalibratedOnUse()


class _DeviceTable(Mapping):
    """Read-only name -> DeviceSpec; the "cpu" entry is calibrated when its numbers are read."""

    def __getitem__(self, name: str) -> DeviceSpec:
        if name == "cpu":
            return _HOST
        return _GPUS[name]

    def __iter__(self):
        return iter(("cpu", *_GPUS))

    def __len__(self) -> int:
        return len(_GPUS) + 1

    def __repr__(self) -> str:
        return f"DEVICES({', '.join(self)})"


DEVICES: Mapping[str, DeviceSpec] = _DeviceTable()


def get_device(name: str) -> DeviceSpec:
    """Case-insensitive lookup in :data:`DEVICES`."""
    key = str(name).strip().lower()
    if key not in DEVICES:
        raise ValueError(f"unknown device {name!r}; valid names: {', '.join(DEVICES)}")
    return DEVICES[key]
