"""Timing on a GPU: host time and device time of an op, apart.

A GPU op costs the host a dispatch and a launch, and the device a kernel; which of the two
bounds a run depends on the model and the batch (that is the question a CUDA graph answers).
Timing a loop of calls with a synchronize at the end measures the larger of the two, and a
synchronize around each op adds the launch latency to both, so every kernel reads long and a
host-bound model looks device-bound.

So the GPU is first held busy by a sleep kernel (``torch.cuda._sleep``, private, used here
only) long enough for the host to queue all the calls; CUDA events around the calls then see
the kernels back to back (device time), while ``perf_counter`` around the same calls sees
only the host's dispatch and launch (host time).
"""
from __future__ import annotations

import statistics
import time

import torch

from fxdream.sim.profile.host_timing import calls_per_block

# Hold the GPU this many times the host's expected queueing time, plus this: a hold that ends
# before the host has queued everything lets gaps into the kernel times, a longer one costs
# only wall time; and the sleep's clock rate is calibrated once, while GPU clocks move.
HOLD_MARGIN = 2.0
HOLD_EXTRA_US = 100.0
# A once-per-device measurement's hold: this many times the host's time, as it costs nothing
EVENT_HOLD_MARGIN = 4.0
_MEASURED: dict[tuple[str, int], float] = {}  # (what, device index) → its measurement


def _once_per_device(what: str, device: torch.device | None, measure) -> float:
    """``measure()`` run once per GPU (with that GPU current), then remembered."""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if (what, index) not in _MEASURED:
        with torch.cuda.device(index):
            _MEASURED[what, index] = measure()
    return _MEASURED[what, index]


def cycles_per_us(device: torch.device | None = None) -> float:
    """Clock cycles of ``torch.cuda._sleep`` per µs on this GPU, measured once per device."""
    def measure():
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cycles = 2_000_000
        # warm up for ~10 ms first: an idle GPU's clock is several times lower (an H200: 345
        # against 1980 MHz), and a rate read before it rises makes every later hold that much shorter
        torch.cuda._sleep(cycles * 10)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / max(start.elapsed_time(end) * 1e3, 1.0)
    return _once_per_device("cycles_per_us", device, measure)


def event_gap_us(device: torch.device | None = None) -> float:
    """Device time an event recorded between two ops adds (measured once per device): in-context
    timing puts one between every two ops and takes it out of the op's time again. The events
    are queued behind a hold several times as long as the host takes to record them (timed on a
    first pass): where the hold ends first, the later events run as the host records them, the
    gap reads the host's pace (µs, not the device's fraction of one), and every op timed in
    context reads that much short."""
    def measure():
        events = [torch.cuda.Event(enable_timing=True) for _ in range(101)]
        started = time.perf_counter()
        for event in events:
            event.record()
        host_us = (time.perf_counter() - started) * 1e6
        events[-1].synchronize()
        hold_gpu(host_us * EVENT_HOLD_MARGIN + HOLD_EXTRA_US)
        for event in events:
            event.record()
        events[-1].synchronize()
        return max(0.0, events[0].elapsed_time(events[-1]) * 1e3 / (len(events) - 1))
    return _once_per_device("event_gap_us", device, measure)


def graph_kernel_saving_us(device: torch.device | None = None, kernels: int = 64) -> float:
    """Device time per kernel that replaying kernels from a CUDA graph saves over launching them
    one by one, both queued behind a hold (so the host is out of it): the GPU starts a graph's
    next kernel sooner. Measured once per device on ``kernels`` one-element adds."""
    def measure():
        x = torch.zeros(1, device=torch.cuda.current_device())

        def launches():
            for _ in range(kernels):
                x.add_(1.0)

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def device_us(run, hold_us) -> float:
            samples = []
            for _ in range(3):
                hold_gpu(hold_us)
                start.record()
                run()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) * 1e3)
            return min(samples)

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            launches()  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            launches()
        one_by_one = device_us(launches, kernels * 30.0 + HOLD_EXTRA_US)
        replayed = device_us(graph.replay, HOLD_EXTRA_US)
        return max(0.0, (one_by_one - replayed) / kernels)
    return _once_per_device("graph_kernel_saving_us", device, measure)


def hold_gpu(us: float, device: torch.device | None = None) -> None:
    """Queue a sleep kernel of about ``us`` µs on the current stream."""
    if us > 0:
        torch.cuda._sleep(int(us * cycles_per_us(device)))


def time_calls_cuda(fn, rounds: int = 5, target_block_us: float = 2000.0) -> tuple[float, float]:
    """(device µs, host µs) per call of ``fn``: medians over ``rounds`` blocks of calls, each
    block queued behind a sleep kernel so its kernels run back to back."""
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    host_once = (time.perf_counter() - started) * 1e6
    torch.cuda.synchronize()
    calls = calls_per_block((time.perf_counter() - started) * 1e6, target_block_us)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device_us, host_us = [], []
    for _ in range(rounds):
        hold_gpu(calls * host_once * HOLD_MARGIN + HOLD_EXTRA_US)
        start.record()
        began = time.perf_counter()
        for _ in range(calls):
            fn()
        host_us.append((time.perf_counter() - began) * 1e6 / calls)
        end.record()
        end.synchronize()
        device_us.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(device_us), statistics.median(host_us)
