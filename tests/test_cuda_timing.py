"""GPU timing keeps host time and device time apart (fxdream.sim.cuda_timing, in-context timing).

On CPU the CUDA calls are replaced by fakes whose events read a clock the fake kernels
advance, so the bookkeeping (which key gets which time) is checked here; the real timings
are checked on a GPU."""
import contextlib

import pytest
import torch
import torch.fx as fx

from fxdream.sim.profile import cuda_timing, in_context
from fxdream.sim.cost.profiled import Profiled
from fxdream.sim.cost.devices import get_device
from fxdream.sim.profile.in_context import HOST

aten = torch.ops.aten


class FakeGpu:
    """A stream whose kernels take ``kernel_us[op]`` of device time each; events read its clock."""

    def __init__(self, kernel_us):
        self.kernel_us, self.clock_us, self.sleeps = kernel_us, 0.0, []
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = gpu.clock_us

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return (other.at - self.at) / 1e3

        self.Event = Event

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "Event", self.Event)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
        monkeypatch.setattr(cuda_timing, "hold_gpu", lambda us, device=None: self.sleeps.append(us))
        monkeypatch.setattr(cuda_timing, "event_gap_us", lambda device=None: 0.5)

    def op(self, name):
        def run(x):
            self.clock_us += self.kernel_us[name]
            return x + 1
        run.__name__ = name
        return run


def _graph(gpu):
    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(gpu.op("small"), (x,))
    b = graph.call_function(gpu.op("large"), (a,))
    graph.output(b)
    return fx.GraphModule(torch.nn.Module(), graph)


def test_in_context_cuda_rounds_keep_device_time_under_the_key_and_host_time_apart(monkeypatch):
    gpu = FakeGpu({"small": 3.0, "large": 400.0})
    gpu.install(monkeypatch)
    gm = _graph(gpu)
    samples = {}
    in_context.time_graph(gm, [torch.zeros(4)], torch.device("cuda"), samples, rounds=3, warmup=0)
    keys = in_context.compute_keys(gm, "cuda")
    assert len(keys) == 2 and all(HOST + k in samples for k in keys)
    small, large = keys
    # less the device time of the event between two ops (0.5 µs here)
    assert samples[small] == pytest.approx([2.5] * 3) and samples[large] == pytest.approx([399.5] * 3)
    assert all(0 < us < 1000 for us in samples[HOST + small])  # the host's own clock, not the kernels'
    # one untimed run first (autotuning; it tells how long the host takes), then each run
    # behind a hold longer than that
    assert len(gpu.sleeps) == 4 and gpu.sleeps[0] == 0 and min(gpu.sleeps[1:]) >= cuda_timing.HOLD_EXTRA_US


def test_work_between_timed_ops_is_charged_to_neither(monkeypatch):
    """A submodule's call (a CUDA-graph region) is not timed; the op after it starts afresh."""
    gpu = FakeGpu({"small": 3.0, "large": 400.0, "region": 50.0})
    gpu.install(monkeypatch)

    class Region(torch.nn.Module):
        def forward(self, x):
            return gpu.op("region")(x)

    graph = fx.Graph()
    x = graph.placeholder("x")
    a = graph.call_function(gpu.op("small"), (x,))
    b = graph.call_module("region", (a,))
    graph.output(graph.call_function(gpu.op("large"), (b,)))
    gm = fx.GraphModule(torch.nn.ModuleDict({"region": Region()}), graph)
    samples = {}
    in_context.time_graph(gm, [torch.zeros(4)], torch.device("cuda"), samples, rounds=2, warmup=0)
    small, large = in_context.compute_keys(gm, "cuda")
    assert samples[small] == pytest.approx([2.5]) and samples[large] == pytest.approx([399.5])  # not 449.5


def test_a_graph_that_syncs_is_not_held(monkeypatch):
    gpu = FakeGpu({"small": 3.0, "large": 4.0})
    gpu.install(monkeypatch)
    graph = fx.Graph()
    x = graph.placeholder("x")
    total = graph.call_function(aten.sum.default, (x,))
    graph.output(graph.call_function(aten._local_scalar_dense.default, (total,)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    in_context.time_graph(gm, [torch.ones(4)], torch.device("cuda"), {}, rounds=2, warmup=0)
    assert gpu.sleeps and set(gpu.sleeps) == {0.0}  # the sync would wait out the hold


def test_a_copy_to_the_cpu_waits_for_the_device():
    """Such a graph is timed without a hold (the copy would wait it out)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    graph = fx.Graph()
    x = graph.placeholder("x")
    copy = graph.call_function(aten._to_copy.default, (x,), {"device": torch.device("cpu")})
    graph.output(graph.call_function(aten.relu.default, (copy,)))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    with FakeTensorMode():  # fake CUDA tensors need no GPU
        x.meta["val"], copy.meta["val"] = torch.empty(2, device="cuda"), torch.empty(2)
    assert in_context._waits_for_the_device(gm)
    x.meta["val"] = copy.meta["val"]  # CPU to CPU: no wait
    assert not in_context._waits_for_the_device(gm)


def test_profiled_on_a_gpu_dispatches_with_the_measured_host_time(monkeypatch):
    gpu = FakeGpu({"small": 3.0, "large": 400.0})
    gpu.install(monkeypatch)
    gm = _graph(gpu)
    cost = Profiled(get_device("h100"), "cuda")
    monkeypatch.setattr(cost, "call_overhead_us", lambda: 1.0)
    small, large = in_context.compute_nodes(gm)
    for node, key in zip((small, large), in_context.compute_keys(gm, "cuda")):
        cost.measurements[key], cost.measurements[HOST + key] = 2.5, 7.0
        assert cost.kernel_us(node) == 2.5 and cost.dispatch_us(node) == 1.0 + 7.0
    cpu = Profiled(get_device("h100"), "cpu")
    monkeypatch.setattr(cpu, "call_overhead_us", lambda: 1.0)
    key = in_context.compute_keys(gm, "cpu")[0]
    cpu.measurements[key] = 2.5
    assert cpu.dispatch_us(small) == 1.0  # on a CPU the op's time is all kernel time


@pytest.mark.cuda
def test_a_tiny_op_is_host_bound_and_a_large_matmul_device_bound():
    tiny = torch.zeros(1, device="cuda")
    device_us, host_us = cuda_timing.time_calls_cuda(lambda: tiny.add(1))
    assert device_us < host_us, (device_us, host_us)
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.float16)
    device_us, host_us = cuda_timing.time_calls_cuda(lambda: a @ a, rounds=3)
    # 137 GFLOP: over 69 µs even at 2 PFLOP/s; the host's part (cuBLAS's heuristics, ~46 µs on
    # an H200) stays apart
    assert device_us > 2 * host_us and device_us > 2 * 4096 ** 3 / 2e15 * 1e6, (device_us, host_us)
    assert 0.0 <= cuda_timing.event_gap_us() < 10.0
    assert 0.0 <= cuda_timing.graph_kernel_saving_us() < 10.0


class QueuedEvents:
    """A GPU whose events each take ``device_us`` once the stream reaches them, recorded by a
    host that takes ``host_us`` per record: behind a hold they run back to back, after it at
    the host's pace."""

    def __init__(self, device_us: float, host_us: float):
        self.device_us, self.host_us, self.host_clock, self.stream_free = device_us, host_us, 0.0, 0.0
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                gpu.host_clock += gpu.host_us
                gpu.stream_free = max(gpu.stream_free, gpu.host_clock) + gpu.device_us
                self.at = gpu.stream_free

            def synchronize(self):
                gpu.host_clock = max(gpu.host_clock, gpu.stream_free)

            def elapsed_time(self, other):
                return (other.at - self.at) / 1e3

        self.Event = Event

    def hold(self, us, device=None):
        self.stream_free = max(self.stream_free, self.host_clock) + us


def test_the_event_gap_is_read_with_every_event_queued_behind_the_hold(monkeypatch):
    """A host that records an event every 8 µs outlasts a fixed 500 µs hold: the gap would read
    ~3 µs (the host's pace) where the device takes 0.5, and every op timed in context would read
    that much short. The hold is sized from the host's own time for the events."""
    gpu = QueuedEvents(device_us=0.5, host_us=8.0)
    monkeypatch.setattr(torch.cuda, "Event", gpu.Event)
    monkeypatch.setattr(cuda_timing, "hold_gpu", gpu.hold)
    monkeypatch.setattr(cuda_timing.time, "perf_counter", lambda: gpu.host_clock * 1e-6)
    monkeypatch.setattr(cuda_timing, "_MEASURED", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda index: contextlib.nullcontext())
    assert cuda_timing.event_gap_us() == pytest.approx(0.5)
