"""Host time outside the captured graphs, measured: what a graph break (and autograd) costs.

After a graph break the model runs eager Python and eager ops between its compiled
subgraphs (dynamo breaks at every ``nn.LSTM`` in training, say); in training, autograd's
engine and its gradient accumulation run around the backward graphs. The simulator sees
only the graphs, so without this a prediction misses that time (GNMT training: -77..-96 %).

``SubgraphClock`` time-stamps every call of a compiled graph while a step runs; the host time
before each call (and after the last) is kept under the label of the graph that follows
(``"g1.fw"``, ``"g0.bw"``, or ``END``), median over runs, and ``lower`` adds it as a host task
there. It is measured on this machine, so it only joins predictions for this machine.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

END = "end"


class SubgraphClock:
    """Records (label, start, end) of each compiled-graph call while ``events`` is a list."""

    def __init__(self):
        self.events: list[tuple[str, float, float]] | None = None

    def wrap(self, boxed: Callable, label: str) -> Callable:
        """``boxed`` (aot's boxed calling convention: one list argument) with a time stamp."""
        def call(args):
            events = self.events
            if events is None:
                return boxed(args)
            started = time.perf_counter()
            try:
                return boxed(args)
            finally:
                events.append((label, started, time.perf_counter()))
        call._boxed_call = True
        return call


def step_gaps(events: list[tuple[str, float, float]], started: float, ended: float) -> dict[str, float]:
    """µs of host time before each labelled call (summed when a label runs twice) and after the last."""
    gaps: dict[str, float] = {}
    cursor = started
    for label, start, end in sorted(events, key=lambda e: e[1]):
        gaps[label] = gaps.get(label, 0.0) + max(0.0, start - cursor) * 1e6
        cursor = max(cursor, end)
    gaps[END] = max(0.0, ended - cursor) * 1e6
    return gaps


def measure_host_gaps(step: Callable[[], object], clock: SubgraphClock, rounds: int = 3,
                      warmup: int = 1) -> tuple[dict[str, float], dict[str, int]]:
    """(median µs of host time before each graph and after the last, calls per step by label)."""
    samples: dict[str, list[float]] = {}
    calls: dict[str, int] = {}
    try:
        for i in range(warmup + rounds):
            clock.events = []
            started = time.perf_counter()
            step()
            ended = time.perf_counter()
            if i < warmup:
                continue
            for label, us in step_gaps(clock.events, started, ended).items():
                samples.setdefault(label, []).append(us)
            calls = {label: sum(e[0] == label for e in clock.events) for label in {e[0] for e in clock.events}}
    finally:
        clock.events = None
    return {label: statistics.median(v) for label, v in samples.items()}, calls


def measure_model_gaps(call: Callable, model, inputs: tuple, training: bool, clock: SubgraphClock,
                       rounds: int = 3, warmup: int = 1) -> tuple[dict[str, float], dict[str, int]]:
    """``measure_host_gaps`` of one call of ``call`` (the compiled model) on ``inputs``: under
    no_grad in inference; in training forward + backward from cleared gradients. The model's
    gradients, buffers and RNG are left as they were."""
    import torch

    from .capture import differentiable_scalar, preserved_state

    def step():
        if not training:
            with torch.no_grad():
                return call(*inputs)
        for p in model.parameters():
            p.grad = None
        scalar = differentiable_scalar(call(*inputs))
        if scalar is not None:
            scalar.backward()

    with preserved_state(model):
        return measure_host_gaps(step, clock, rounds, warmup)


def describe_gaps(gaps: dict[str, float], calls: dict[str, int], subgraphs: int, training: bool) -> tuple[str, ...]:
    """Report lines: how much host time was measured outside the graphs, and repeated graphs."""
    causes = ([f"{subgraphs - 1} graph break(s)"] if subgraphs > 1 else []) + (["autograd"] if training else [])
    lines = (f"measured host time outside the graphs ({', '.join(causes)}): "
             f"{sum(gaps.values()) / 1e3:.3f} ms per step, simulated as host tasks",)
    repeated = {label: n for label, n in calls.items() if n > 1}
    if repeated:
        lines += (f"graphs called more than once per step, simulated once: {repeated}",)
    return lines
