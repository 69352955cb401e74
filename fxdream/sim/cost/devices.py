"""Device specs for the analytic cost model: datasheet GPUs and a calibrated host CPU.

GPU figures are dense (no 2:4 sparsity) peaks from NVIDIA's public datasheets; ``float32`` is
the non-tensor-core FP32 rate, ``tf32``/``float16``/``bfloat16`` the tensor-core rates; memory
sizes take the datasheet's "GB" as GiB (HBM stacks are binary sizes).  The overhead fields are
on no datasheet; they come from an H100 SXM machine (PyTorch 2.11, CUDA 13), where a 1-element
``torch.add`` costs 1.5 µs of CPU on CPU tensors (dispatch) and 6.6 µs on CUDA tensors, so
launching costs ~5 µs more; a tiny kernel replayed in a CUDA graph takes 1.2 µs of GPU time.
Hopper entries use these; V100/A100 use the same host costs and a longer floor (estimates).

A GPU with a ``fits/<name>.json`` (``benchmarks/fit_gpu_model.py``) takes the overheads, the
kernel floor and the share of the roofline each kernel class reaches from that file: fitted
to measurements of captured graphs on that GPU, which datasheet figures overrate several
times at small batches; a GPU with the same SMs takes its sibling's (``FIT_OF_SAME_SMS``).
``datasheet_device(name)`` keeps the datasheet-only spec.
"""
from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import torch

from fxdream.ir.flops import CONV_CLASSES, KERNEL_CLASSES
from fxdream.sim.profile.machine_load import watch_machine_load

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
    # Share of the roofline kernels of each class reach ("conv", "conv_1x1", "gemm", "batch_norm", "other":
    # ``fxdream.ir.flops.kernel_class``); a class not named reaches all of it.
    roofline_share: Mapping[str, float] = field(default_factory=dict)
    # µs each kernel of a class takes besides its work (ramp-up, the last partial wave, the
    # tail): measured kernels reach a share of the roofline that grows with their work, from
    # none for a kernel of no work to the class's share for a long one; a class not named: 0.
    kernel_startup_us: Mapping[str, float] = field(default_factory=dict)
    # The launch cost (the library's host work for one kernel) of each class over that of an op
    # of class "other": cuDNN's convolutions and batch norms set up descriptors on the host; a
    # class not named costs the same as "other". The framework's dispatch is the same for all.
    host_factor: Mapping[str, float] = field(default_factory=dict)
    source: str = "datasheet"        # where the overheads and shares come from
    # Host µs of autograd's engine in a training step: running one node (a compiled backward),
    # and one AccumulateGrad (handing a parameter its .grad); host work whatever the device.
    autograd_node_us: float = 0.0
    accumulate_grad_us: float = 0.0
    # The shares and startups were fitted to measured kernel times, which already contain what
    # a kernel that fills part of the device loses: a fill model must not add it again.
    kernels_measured: bool = False
    # (lowest, highest) measured / predicted time over the whole models a fit was checked on
    # (its fit and held-out cases): an analytic prediction's range on this spec. None where no
    # measurement of this GPU (or one with the same SMs) says how far its predictions err.
    error_ratios: tuple[float, float] | None = None
    # A calibration of this host taken while other processes kept its cores busy: what they did
    # (its peaks can read several times low: a matmul's threads wait on a core that is taken).
    calibration_disturbed: str | None = None

    def __post_init__(self):
        if self.kind not in ("cpu", "cuda"):
            raise ValueError(f"DeviceSpec.kind must be 'cpu' or 'cuda', got {self.kind!r}")
        object.__setattr__(self, "peak_flops", MappingProxyType(dict(self.peak_flops)))
        object.__setattr__(self, "roofline_share", MappingProxyType(dict(self.roofline_share)))
        object.__setattr__(self, "host_factor", MappingProxyType(dict(self.host_factor)))
        object.__setattr__(self, "kernel_startup_us", MappingProxyType(dict(self.kernel_startup_us)))
        bad = {k: v for k, v in self.roofline_share.items() if not 0 < v <= 1}
        if bad:
            raise ValueError(f"DeviceSpec.roofline_share values must be in (0, 1], got {bad}")
        bad = {k: v for k, v in self.host_factor.items() if not v > 0}
        if bad:
            raise ValueError(f"DeviceSpec.host_factor values must be positive, got {bad}")
        bad = {k: v for k, v in self.kernel_startup_us.items() if not v >= 0}
        if bad:
            raise ValueError(f"DeviceSpec.kernel_startup_us values must be >= 0, got {bad}")

    def share(self, kernel_class: str) -> float:
        """Share of the roofline a kernel of ``kernel_class`` reaches (1.0 where not fitted)."""
        return self.roofline_share.get(kernel_class, 1.0)

    def host_us(self, kernel_class: str) -> float:
        """Host µs to dispatch and launch one op of ``kernel_class`` (not a view)."""
        return self.dispatch_overhead_us + self.launch_overhead_us * self.host_factor.get(kernel_class, 1.0)

    def flops(self, dtype="float32") -> float:
        """Peak FLOP/s for ``dtype`` (a torch.dtype or its name); a dtype without its own entry
        (bf16 on V100, anything on a CPU calibrated in fp32) falls back to float32."""
        key = dtype_name(dtype)
        return self.peak_flops.get(key) or self.peak_flops["float32"]

    def math_dtype(self, dtype, kernel_class: str, tf32_conv: bool, tf32_matmul: bool) -> str:
        """The rate a kernel computes at: a float32 convolution on TF32 tensor cores where cuDNN
        may use them (``tf32_conv``: torch.backends.cudnn.allow_tf32, on by default), a float32
        GEMM where matmuls may (``tf32_matmul``: torch.backends.cuda.matmul.allow_tf32, off by
        default); ``dtype`` itself otherwise, and on a device without a TF32 rate."""
        key = dtype_name(dtype)
        allowed = tf32_conv if kernel_class in CONV_CLASSES else tf32_matmul if kernel_class == "gemm" else False
        return "tf32" if key == "float32" and allowed and "tf32" in self.peak_flops else key

    def kernel_time_us(self, flops: float, bytes_moved: float, dtype="float32", kernel_class: str = "other",
                       kernels: int = 1) -> float:
        """Time of ``kernels`` kernels doing this work in all: the class's startup for each, plus
        the roofline time, max(compute, memory), over the class's share of the roofline; at
        least ``kernel_min_us`` each."""
        roofline_us = max(flops / self.flops(dtype), bytes_moved / self.mem_bandwidth) * 1e6
        t = kernels * self.kernel_startup_us.get(kernel_class, 0.0) + roofline_us / self.share(kernel_class)
        return max(t, kernels * self.kernel_min_us)


_DTYPE_ALIASES = {"float": "float32", "half": "float16", "bf16": "bfloat16", "fp32": "float32", "fp16": "float16"}


def dtype_name(dtype) -> str:
    """The ``peak_flops`` key of ``dtype``: a torch.dtype or a name ("float", "fp16", "bf16"...)."""
    key = str(dtype).removeprefix("torch.")
    return _DTYPE_ALIASES.get(key, key)


def _gpu(name, fp32, tf32, fp16, bf16, fp64, bw, sms, mem_gib, launch=5.0, dispatch=1.5, kmin=1.2):
    peaks = {"float32": fp32, "float16": fp16, "float64": fp64}
    if tf32:
        peaks["tf32"] = tf32
    if bf16:
        peaks["bfloat16"] = bf16
    return DeviceSpec(name, "cuda", peaks, bw, launch, dispatch, kmin, sms, mem_gib * GiB,
                      autograd_node_us=AUTOGRAD_NODE_US, accumulate_grad_us=ACCUMULATE_GRAD_US)


# Autograd engine host costs for GPU specs: estimates of the order calibrate_cpu measures on a
# 2-core x86 host (3.4 µs per engine node, 3.3 µs per AccumulateGrad that takes a new .grad).
AUTOGRAD_NODE_US = 4.0
ACCUMULATE_GRAD_US = 4.0


T = 1e12
_DATASHEET = {
    # NVIDIA Tesla V100 GPU Accelerator datasheet (SXM2 32 GB, 2018): FP64 7.8, FP32 15.7 TFLOPS,
    # Tensor (FP16) 125 TFLOPS, HBM2 900 GB/s, 32 GB; 80 SMs (Volta V100 whitepaper).  No
    # TF32/BF16 (bf16 falls back to fp32 in DeviceSpec.flops).
    "v100": _gpu("v100", 15.7 * T, None, 125 * T, None, 7.8 * T, 900e9, 80, 32, kmin=2.5),
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4 80 GB, 2021): FP64 Tensor Core 19.5 (FP64 9.7;
    # cuBLAS's DGEMM runs on the tensor cores), FP32 19.5, TF32 156, BF16/FP16 312 TFLOPS (dense;
    # 312/624 are the sparsity figures), HBM2e 2,039 GB/s, 80 GB; 108 SMs (Ampere GA100 whitepaper).
    "a100": _gpu("a100", 19.5 * T, 156 * T, 312 * T, 312 * T, 19.5 * T, 2039e9, 108, 80, kmin=2.0),
    # NVIDIA H100 Tensor Core GPU datasheet (H100 SXM5 80 GB): FP64 Tensor Core 67 (FP64 34), FP32
    # 67 TFLOPS; TF32 989, BF16/FP16 1,979 TFLOPS are with sparsity -> dense 494.7 / 989.4 (Hopper
    # whitepaper table); HBM3 3.35 TB/s, 80 GB; 132 SMs.
    "h100": _gpu("h100", 67 * T, 494.7 * T, 989.4 * T, 989.4 * T, 67 * T, 3.35e12, 132, 80),
    # NVIDIA H200 Tensor Core GPU datasheet (H200 SXM, 2024): same compute as H100 SXM
    # (FP64 Tensor Core 67, FP32 67, TF32 989*, BF16/FP16 1,979* TFLOPS, * = with sparsity ->
    # halved), HBM3e 4.8 TB/s, 141 GB; 132 SMs.
    "h200": _gpu("h200", 67 * T, 494.7 * T, 989.4 * T, 989.4 * T, 67 * T, 4.8e12, 132, 141),
}

FITS_DIR = Path(__file__).parent / "fits"  # <device>.json: parameters fitted to measurements
# per kernel class, FITTABLE as "<field>.<class>"; the value of a class not named
MAPPED = {"roofline_share": 1.0, "kernel_startup_us": 0.0, "host_factor": 1.0}
FITTABLE = ("dispatch_overhead_us", "launch_overhead_us", "kernel_min_us",
            *(f"roofline_share.{c}" for c in KERNEL_CLASSES),
            *(f"kernel_startup_us.{c}" for c in KERNEL_CLASSES),
            *(f"host_factor.{c}" for c in KERNEL_CLASSES if c != "other"))


def with_parameters(spec: DeviceSpec, values: Mapping[str, float], source: str | None = None) -> DeviceSpec:
    """``spec`` with the ``FITTABLE`` fields in ``values`` replaced ("roofline_share.conv"
    sets one class's share), and its ``source``."""
    unknown = sorted(set(values) - set(FITTABLE))
    if unknown:
        raise ValueError(f"not fittable DeviceSpec parameters: {unknown}; valid: {', '.join(FITTABLE)}")
    mapped = {name: dict(getattr(spec, name)) for name in MAPPED}
    plain = {}
    for key, value in values.items():
        name, _, kernel_class = key.partition(".")
        if kernel_class:
            mapped[name][kernel_class] = float(value)
        else:
            plain[key] = float(value)
    return dataclasses.replace(spec, **plain, **mapped, source=source or spec.source)


def parameters_of(spec: DeviceSpec, names=FITTABLE) -> dict[str, float]:
    """The values of ``names`` (``FITTABLE`` entries) in ``spec``."""
    def value(name: str) -> float:
        field_name, _, kernel_class = name.partition(".")
        return getattr(spec, field_name).get(kernel_class, MAPPED[field_name]) if kernel_class else getattr(spec, name)
    return {n: value(n) for n in names}


def with_fit(spec: DeviceSpec, path: Path, source: str | None = None) -> DeviceSpec:
    """``spec`` with the parameters of a fit file (``benchmarks/fit_gpu_model.py``), its kernel
    model marked as fitted to measured kernels (``kernels_measured``)."""
    fit = json.loads(Path(path).read_text())
    fitted = with_parameters(spec, fit["parameters"], source or f"fitted to {fit['fitted_on']} ({Path(path).name})")
    return dataclasses.replace(fitted, kernels_measured=True, error_ratios=checked_error_ratios(fit))


def checked_error_ratios(fit: Mapping) -> tuple[float, float] | None:
    """(lowest, highest) measured / fitted time over a fit file's whole-model cases, fitted and
    held out; None where it has none."""
    ratios = [row["measured_ms"] / row["fitted_ms"] for row in [*fit.get("fit", ()), *fit.get("held_out", ())]
              if row.get("fitted_ms")]
    return (min(ratios), max(ratios)) if ratios else None


# A GPU without a fit of its own takes the fit of one with the same SMs (count, clocks, tensor
# cores) and the same software, with its own datasheet peaks, bandwidth and memory: the H100 SXM
# and H200 are one Hopper GH100 die (132 SMs, the same FLOP/s) with HBM3 3.35 against HBM3e
# 4.8 TB/s. Across generations it is a default, not a measurement (``DEFAULT_FIT``): the H200's
# startups and shares put a V100's ResNet-50 bs1 kernels at 0.63x and its bs128 ones at 1.34x
# the seed's times, where the datasheet's put them at 0.40x and 0.71x (docs/simulator.md).
FIT_OF_SAME_SMS = {"h100": "h200"}


# A GPU with no fit of its own (nor a sibling's) takes a measured fit's parameters with its own
# datasheet peaks, bandwidth and memory: the host's costs per op are PyTorch's and the driver's on
# the host, not the GPU's, and the kernels' startups and shares of the roofline are cuDNN's and
# cuBLAS's efficiency, which a datasheet's 100 % of the peak overstates on any GPU. Datasheet
# figures would put a host-bound model 5-7x faster on a V100 than on the fitted H100, and an
# A100's convolutions at the roofline where the H100's run at a third of it.
DEFAULT_FIT = "h200"


def _fitted(spec: DeviceSpec) -> DeviceSpec:
    """The datasheet spec with the parameters of ``fits/<name>.json`` where that file exists
    (written from measurements on that device), else of its ``FIT_OF_SAME_SMS`` sibling's, else
    of the ``DEFAULT_FIT`` device's."""
    own = FITS_DIR / f"{spec.name}.json"
    if own.exists():
        return with_fit(spec, own)
    sibling = FITS_DIR / f"{FIT_OF_SAME_SMS.get(spec.name, DEFAULT_FIT)}.json"
    if not sibling.exists():
        return spec
    fitted = with_fit(spec, sibling)
    same_sms = spec.name in FIT_OF_SAME_SMS
    why = "the same SMs" if same_sms else "not measured on this GPU"
    # across generations the fit's checked errors say nothing of this GPU's: no range
    return dataclasses.replace(fitted, source=f"{fitted.source}: {why}; {spec.name}'s own datasheet "
                                              f"peaks, bandwidth and memory",
                               error_ratios=fitted.error_ratios if same_sms else None)


def datasheet_device(name: str) -> DeviceSpec:
    """A GPU's spec from its datasheet alone, without fitted parameters."""
    key = str(name).strip().lower()
    if key not in _DATASHEET:
        raise ValueError(f"no datasheet GPU {name!r}; valid names: {', '.join(_DATASHEET)}")
    return _DATASHEET[key]


_GPUS = {name: _fitted(spec) for name, spec in _DATASHEET.items()}

_CPU_CACHE: dict[str, DeviceSpec] = {}  # the one global mutable: calibration, once per process


def calibrate_cpu(seconds: float = 0.1, *, refresh: bool = False, tries: int = 3) -> DeviceSpec:
    """Measure this host: fp32 and fp64 matmul FLOP/s (and bf16's, on a CPU with native bf16), copy
    bandwidth, per-op dispatch overhead, and autograd's engine costs (per node, per AccumulateGrad).

    About ``seconds`` in total (split between the eight or nine timings), cached for the process unless
    ``refresh``.  Where other processes kept the cores busy meanwhile it calibrates again, up to
    ``tries`` times, and a spec measured busy each time says so (``calibration_disturbed``).
    Best-of-N timings: the peak is what the roofline needs.  The host's spec in ``DEVICES``
    calls it when one of its numbers is first read (analytic costs, what-ifs); the default is
    short because a longer calibration gives the same peaks within a few %."""
    if "cpu" in _CPU_CACHE and not refresh:
        return _CPU_CACHE["cpu"]
    for _ in range(tries):
        with watch_machine_load() as load:
            spec = _calibrated(seconds)
        if not load.disturbed:
            break
    else:
        spec = dataclasses.replace(spec, calibration_disturbed=load.describe("calibration"))
    _CPU_CACHE["cpu"] = spec
    return spec


def _calibrated(seconds: float) -> DeviceSpec:
    """``calibrate_cpu``'s measurements, taken now."""
    dtypes = (torch.float32, torch.float64) + ((torch.bfloat16,) if native_bf16() else ())
    budget = max(0.05, float(seconds)) / (len(dtypes) + 6)  # a matmul per dtype, copy, dispatch, 4 autograd

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
    peaks = {}
    for dtype in dtypes:
        a, b_ = torch.randn(n, n, dtype=dtype), torch.randn(n, n, dtype=dtype)
        out = torch.empty(n, n, dtype=dtype)
        peaks[str(dtype).removeprefix("torch.")] = 2 * n ** 3 / best(lambda: torch.mm(a, b_, out=out))
    src = torch.ones(64 * 2 ** 20 // 4)  # 64 MiB (x2 with dst): past most last-level caches
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 4 / best(lambda: dst.copy_(src))  # read + write
    x, y = torch.zeros(1), torch.zeros(1)
    k = 200

    def tiny():
        for _ in range(k):
            torch.add(x, y)
    dispatch_us = best(tiny) / k * 1e6
    node_us, accumulate_us = _autograd_costs(best)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 0
    return DeviceSpec("cpu", "cpu", peaks, bw, launch_overhead_us=0.0,
                      dispatch_overhead_us=dispatch_us, kernel_min_us=0.0, num_sms=None,
                      memory_bytes=mem, source="calibrated on this host", autograd_node_us=node_us,
                      accumulate_grad_us=accumulate_us)


def native_bf16() -> bool:
    """Whether this CPU runs bf16 natively (AVX-512 BF16 or AMX) and oneDNN can use it."""
    return (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
            and (torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()))


def _autograd_costs(best) -> tuple[float, float]:
    """(µs per engine node, µs per AccumulateGrad): the slopes of a backward through a chain of
    k adds, over k, without and with a leaf tensor (a parameter) at each add."""
    def backward_us(k: int, leaves: bool) -> float:
        x = torch.zeros(4, requires_grad=True)
        addends = [torch.zeros(4, requires_grad=leaves) for _ in range(k)]

        def step():
            for t in (x, *addends):
                t.grad = None
            y = x
            for a in addends:
                y = y + a
            y.sum().backward()
        return best(step) * 1e6
    short, long = 8, 64
    with torch.inference_mode(False), torch.enable_grad():  # the caller may be in no_grad
        node = max(0.0, (backward_us(long, False) - backward_us(short, False)) / (long - short))
        with_leaves = max(0.0, (backward_us(long, True) - backward_us(short, True)) / (long - short))
    return node, max(0.0, with_leaves - node)


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
                            ("kernel_min_us", 0.0), ("num_sms", None),
                            ("roofline_share", MappingProxyType({})), ("host_factor", MappingProxyType({})),
                            ("kernel_startup_us", MappingProxyType({})), ("kernels_measured", False),
                            ("error_ratios", None), ("source", "calibrated on this host")):
            object.__setattr__(self, name, value)


for _measured in ("peak_flops", "mem_bandwidth", "dispatch_overhead_us", "memory_bytes", "autograd_node_us",
                  "accumulate_grad_us", "calibration_disturbed"):
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
