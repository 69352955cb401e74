"""Device table and CPU calibration."""
import dataclasses
import time

import pytest
import torch

from fxdream.capturing import capture
from fxdream.sim import DEVICES, DeviceSpec, calibrate_cpu, get_device
from fxdream.sim.cost.analytic import Analytic
from fxdream.sim.cost.devices import datasheet_device


def test_get_device_case_insensitive_and_datasheet_values():
    h = get_device("H100")
    assert h is get_device("h100") and h.kind == "cuda"
    assert h.peak_flops["float32"] == 67e12                     # non-tensor-core FP32
    assert h.flops("bfloat16") == pytest.approx(989.4e12)       # dense, not sparsity
    assert get_device("v100").flops("float16") == 125e12
    assert get_device("v100").flops("bfloat16") == 15.7e12      # no bf16 on Volta: fp32
    assert get_device("a100").flops("tf32") == 156e12
    assert get_device("h200").mem_bandwidth == 4.8e12
    assert get_device("a100").num_sms == 108
    for name in ("v100", "a100", "h100", "h200"):
        d = DEVICES[name]
        assert d.launch_overhead_us > 0 and d.kernel_min_us > 0 and d.memory_bytes > 0


def test_float64_runs_at_each_devices_float64_rate():
    """A float64 GEMM at the datasheet's FP64 rate: half the FP32 rate on a V100 (no FP64 tensor
    cores), the FP64 tensor cores' on an A100 and an H100 (cuBLAS's DGEMM), the calibrated rate
    on this CPU; not the float32 rate for all."""
    assert get_device("v100").flops(torch.float64) == 7.8e12
    assert get_device("a100").flops("float64") == 19.5e12 and get_device("h100").flops("float64") == 67e12
    assert calibrate_cpu().peak_flops["float64"] > 0  # measured on its own (its speed is not asserted: timed)
    gemm = {}
    for dtype in (torch.float32, torch.float64):
        linear, x = torch.nn.Linear(4096, 4096, device="meta", dtype=dtype), torch.randn(4096, 4096, device="meta",
                                                                                         dtype=dtype)
        graph = capture(linear, (x,)).forward.graph
        node = next(n for n in graph.nodes if n.op == "call_function" and "addmm" in str(n.target))
        gemm[dtype] = Analytic(get_device("v100")).kernel_us(node)
    assert gemm[torch.float64] == pytest.approx(2 * gemm[torch.float32], rel=0.05)  # compute-bound at this size


def test_get_device_error_lists_valid_names():
    with pytest.raises(ValueError) as e:
        get_device("tpu-v4")
    for name in ("cpu", "v100", "a100", "h100", "h200"):
        assert name in str(e.value)


def test_kernel_time_is_a_roofline():
    a = datasheet_device("a100")  # no fitted startups or shares: the roofline itself
    # 312e12 FLOP at 312 TFLOP/s (fp16) = 1 s = 1e6 µs; bytes negligible
    assert a.kernel_time_us(312e12, 1.0, "float16") == pytest.approx(1e6)
    # 2039e9 bytes at 2039 GB/s = 1 s, compute negligible
    assert a.kernel_time_us(1.0, 2039e9) == pytest.approx(1e6)
    assert a.kernel_time_us(0, 0) == a.kernel_min_us            # never below the floor


@pytest.mark.parametrize("dtype,klass,flags,expected", [
    ("float32", "conv", (True, False), "tf32"),        # cuDNN's default: TF32 tensor cores
    ("float32", "conv", (False, False), "float32"),    # torch.backends.cudnn.allow_tf32 off
    ("float32", "gemm", (True, False), "float32"),     # matmul's default: full float32
    ("float32", "gemm", (True, True), "tf32"),         # torch.backends.cuda.matmul.allow_tf32 on
    ("float32", "other", (True, True), "float32"),     # pointwise kernels have no TF32 rate
    ("float16", "conv", (True, True), "float16"),
])
def test_the_math_dtype_follows_torchs_tf32_flags(dtype, klass, flags, expected):
    assert get_device("a100").math_dtype(dtype, klass, *flags) == expected
    assert get_device("v100").math_dtype(dtype, klass, *flags) == dtype  # no TF32 on Volta


def test_the_analytic_model_runs_a_float32_convolution_at_the_tf32_rate_unless_turned_off():
    conv = torch.nn.Conv2d(64, 64, 3, padding=1).eval()
    graph = capture(conv, (torch.randn(8, 64, 56, 56),)).forward.graph
    node = next(n for n in graph.nodes if n.op == "call_function" and "convolution" in str(n.target))
    a100 = datasheet_device("a100")  # the roofline at 100 %: the rates alone decide
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=True):
        tf32_us = Analytic(a100).kernel_us(node)
    with torch.backends.cudnn.flags(enabled=True, allow_tf32=False):
        fp32_us = Analytic(a100).kernel_us(node)
    flops = 2 * 8 * 64 * 56 * 56 * 64 * 9
    assert fp32_us == pytest.approx(flops / a100.flops("float32") * 1e6, rel=0.01)   # compute-bound
    assert tf32_us < fp32_us / 2


def test_device_spec_validates_kind():
    with pytest.raises(ValueError):
        DeviceSpec("x", "tpu", {"float32": 1.0}, 1.0, 0, 0, 0, None, 0)


def test_calibrate_cpu_is_fast_and_cached():
    t0 = time.perf_counter()
    c = calibrate_cpu(seconds=0.3, refresh=True)
    assert time.perf_counter() - t0 < 2.0
    assert c.kind == "cpu" and c.num_sms is None
    assert c.peak_flops["float32"] > 1e8                        # > 0.1 GFLOP/s on anything
    from fxdream.sim.cost.devices import native_bf16
    assert ("bfloat16" in c.peak_flops) == native_bf16()        # bf16 measured where it runs natively
    assert c.mem_bandwidth > 1e8 and c.dispatch_overhead_us > 0
    assert calibrate_cpu() is c                                  # cached per process
    host = get_device("CPU")                                     # its numbers are the calibration's
    assert host is get_device("cpu") and host.peak_flops == c.peak_flops and host.mem_bandwidth == c.mem_bandwidth


def test_the_host_spec_calibrates_when_a_number_is_read(monkeypatch):
    from fxdream.sim.cost import devices
    monkeypatch.setattr(devices, "_CPU_CACHE", {})
    host = get_device("cpu")
    assert (host.name, host.kind, host.num_sms, host.launch_overhead_us) == ("cpu", "cpu", None, 0.0)
    assert devices._CPU_CACHE == {}                              # a measured-cost build reads no more
    assert host.dispatch_overhead_us > 0 and "cpu" in devices._CPU_CACHE
    widened = dataclasses.replace(host, peak_flops={"float32": 1.0, "bfloat16": 2.0})
    assert type(widened) is DeviceSpec and widened.flops("bfloat16") == 2.0
    assert widened.mem_bandwidth == host.mem_bandwidth


def test_calibration_measures_the_autograd_engine():
    host = calibrate_cpu(seconds=0.2, refresh=True)
    assert 0 < host.autograd_node_us < 1000 and 0 <= host.accumulate_grad_us < 1000
    assert get_device("cpu").autograd_node_us == host.autograd_node_us
    assert get_device("h100").autograd_node_us > 0 and get_device("h100").accumulate_grad_us > 0


def test_calibration_runs_inside_no_grad_and_inference_mode():
    with torch.no_grad():
        assert calibrate_cpu(seconds=0.05, refresh=True).autograd_node_us > 0
    with torch.inference_mode():
        assert calibrate_cpu(seconds=0.05, refresh=True).autograd_node_us > 0
