"""Timing loops on this machine, and the host overheads per op and per graph call they measure
for ``Profiled`` (the Python of generated FX code; entering a captured module)."""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch
import torch.fx as fx

from fxdream.runtime.direct_calls import call_ops_directly


def calls_per_block(once_us: float, target_block_us: float) -> int:
    """Calls in a timed block that takes about ``target_block_us`` (1 to 1000)."""
    return max(1, min(1000, int(target_block_us / max(once_us, 0.05))))


def _time_calls(fn, rounds: int = 5, target_block_us: float = 2000.0, cuda: bool = False) -> float:
    """Median µs per call over ``rounds`` blocks sized to take about ``target_block_us``."""
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    fn()
    sync()
    started = time.perf_counter()
    fn()
    sync()
    calls = calls_per_block((time.perf_counter() - started) * 1e6, target_block_us)
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        samples.append((time.perf_counter() - started) * 1e6 / calls)
    return statistics.median(samples)


# Timing loops of the per-call overheads every build measures once: 5 blocks of ~1 ms. More
# or longer blocks cost build time and read the same within their run-to-run noise.
OVERHEAD_ROUNDS, OVERHEAD_BLOCK_US = 5, 1000.0

_CALL_OVERHEAD_US: list[float] = []


def measure_call_overhead_us() -> float:
    """Python cost per op of generated FX code beyond the op itself (boxing, frame, locals)."""
    if not _CALL_OVERHEAD_US:
        graph = fx.Graph()
        x = graph.placeholder("x")
        y = x
        for _ in range(100):
            y = graph.call_function(torch.ops.aten.alias.default, (y,))
        graph.output(y)
        gm = call_ops_directly(fx.GraphModule(torch.nn.Module(), graph))
        t = torch.empty(1)
        through_graph = _time_calls(lambda: gm(t), OVERHEAD_ROUNDS, OVERHEAD_BLOCK_US)
        direct = _time_calls(lambda: _alias_chain(t), OVERHEAD_ROUNDS, OVERHEAD_BLOCK_US)
        _CALL_OVERHEAD_US.append(max(0.0, (through_graph - direct) / 100))
    return _CALL_OVERHEAD_US[0]


class _AddOne(torch.nn.Module):
    def forward(self, x):
        return x + 1


ModuleBuilder = Callable[[torch.nn.Module, tuple], Callable]
"""(module, example inputs) → a callable that runs the module as a build would."""


def as_graph_module(module: torch.nn.Module, _inputs: tuple) -> Callable:
    """The module as generated FX code alone (``symbolic_trace``, ops called directly): the
    least a captured graph's call costs, without the guards and wrappers a build adds."""
    return call_ops_directly(fx.symbolic_trace(module))


def measure_graph_call_us(device: torch.device, build: ModuleBuilder) -> float:
    """Per-call cost of a one-op module run as ``build`` makes it, beyond its one op. The
    user-facing layer passes the builder of an fxdream build (``fxdream.cost_models``), so the
    cost is that of the module a user calls; nothing here builds one itself."""
    x = torch.zeros(1, device=device)
    module = build(_AddOne(), (x,))
    cuda = device.type == "cuda"
    with torch.no_grad():
        through_graph = _time_calls(lambda: module(x), OVERHEAD_ROUNDS, OVERHEAD_BLOCK_US, cuda=cuda)
        direct = _time_calls(lambda: torch.ops.aten.add.Tensor._op(x, 1), OVERHEAD_ROUNDS, OVERHEAD_BLOCK_US, cuda=cuda)
    return max(0.0, through_graph - direct)


def measure_view_us(device: torch.device) -> float:
    """Cost of one view op (``aten.view`` of a small tensor) from Python."""
    x = torch.empty(8, 8, device=device)
    return _time_calls(lambda: torch.ops.aten.view.default._op(x, [64]), OVERHEAD_ROUNDS, OVERHEAD_BLOCK_US)


def _alias_chain(t):
    alias = torch.ops.aten.alias.default._op  # as graph code calls it (``direct_calls``)
    for _ in range(100):
        t = alias(t)
    return t
