"""The step as it ran: which compiled graphs it called, in what order, and the host time around them.

After a graph break the model runs eager Python and eager ops between its compiled
subgraphs (dynamo breaks at every ``nn.LSTM`` in training, say), and a subgraph compiled for
a block that repeats (a layer with a graph break inside, called once per layer) runs several
times per step; in training, autograd's engine and its gradient accumulation run around the
backward graphs. The simulator sees the graphs only, each once, so without this a prediction
misses all of that: most of the step for a model that breaks often (GNMT in training).

``SubgraphClock`` time-stamps every call of a compiled graph while a step runs;
``measure_host_gaps`` keeps the sequence of calls and the host time before each call and
after the last (``StepCalls``, medians over runs), and ``lower_captured`` lowers the graphs in
that sequence, each call once, with one host task per gap. It is measured on this machine,
so it only joins predictions for this machine.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fxdream.capturing.gap_layers import gap_bounds, gap_layers, module_calls
from fxdream.capturing.keywords import call_values
from fxdream.capturing.model_state import preserved_state, python_objects_restorer
from fxdream.capturing.steps import seeded_step

END = "end"
GRAPH_CALL_PREFIX = "fxdream.graph:"  # a graph call's profiler range while eager ops are recorded: this + label
STEP_RANGE = "fxdream.step"  # and each step's


@dataclass(frozen=True)
class StepCalls:
    """One step: graph labels ("g0.fw", "g1.bw") in call order, µs of host time before each
    call, and after the last. ``measured`` False: only the order was recorded (a step on the
    meta device, or for another device), its gaps are zeros. ``input_storages``: the storages
    (``_cdata``) of the tensors its graph calls took, where recorded: a graph called once per
    layer takes each layer's parameters on its own call."""
    calls: tuple[str, ...]
    gaps_us: tuple[float, ...]
    end_us: float
    measured: bool = True
    input_storages: frozenset[int] = frozenset()
    # each call's (old, new) layer prefix, where the call ran a graph shared by instances of one
    # block for another instance than it was named for (``call_layers``)
    call_layers: tuple = ()
    # where not measured: the eager ATen ops run before call k (key k; END: after the last) as
    # (phase, graph) pairs in the order they ran, and the ops that could not be replayed by name
    # (fxdream.capturing.eager_ops)
    eager_before: Mapping[object, tuple[tuple[str, fx.GraphModule], ...]] = field(default_factory=dict)
    eager_skipped: Mapping[str, int] = field(default_factory=dict)
    # where named: per gap (before each call, then after the last) the modules that ran in it, as
    # (name, share of the gap) (fxdream.capturing.gap_layers)
    gap_layers: tuple[tuple[tuple[str, float], ...], ...] = ()
    # where measured: µs each call took (the compiled graph with its wrappers), in call order
    calls_us: tuple[float, ...] = ()
    # where measured: µs of each sampled step in all (gaps and calls), for the run-to-run spread
    steps_us: tuple[float, ...] = ()

    @property
    def total_us(self) -> float:
        return sum(self.gaps_us) + self.end_us

    def counts(self) -> dict[str, int]:
        return dict(collections.Counter(self.calls))

    @classmethod
    def median(cls, samples: Sequence["StepCalls"]) -> "StepCalls":
        """The most frequent call sequence (the latest on a tie), with per-position medians of
        the samples that ran it (a data-dependent branch can call other graphs)."""
        order = collections.Counter(s.calls for s in samples)
        calls = max(order, key=lambda c: (order[c], max(i for i, s in enumerate(samples) if s.calls == c)))
        same = [s for s in samples if s.calls == calls]
        gaps = tuple(statistics.median(s.gaps_us[i] for s in same) for i in range(len(calls)))
        timed = [s for s in same if len(s.calls_us) == len(calls)]
        calls_us = tuple(statistics.median(s.calls_us[i] for s in timed) for i in range(len(calls))) if timed else ()
        return cls(calls, gaps, statistics.median(s.end_us for s in same), calls_us=calls_us,
                   steps_us=tuple(s.total_us + sum(s.calls_us) for s in same))


def worth_measuring(training: bool, subgraphs: int, graph_breaks: int = 0) -> bool:
    """Only training steps (autograd) and graph breaks have host time outside the graphs that
    matters; one inference graph is one call with next to nothing around it, unless the graph
    broke (eager code before or after the one graph captured: an RNN dynamo does not trace, a
    ``.item()``), or nothing was captured at all (the whole step is eager code)."""
    return training or subgraphs != 1 or graph_breaks > 0


class SubgraphClock:
    """Records (label, start, end) of each compiled-graph call while ``events`` is a list, and
    counts the graphs the session compiles (``compilations``): a step that compiled is not a
    step whose host time the model spends."""

    def __init__(self):
        # (label, start, end, start of the call itself: after the clock's own bookkeeping) per call
        self.events: list[tuple[str, float, float, float]] | None = None
        self.compilations = 0
        self.call_storages: list[frozenset[int]] | None = None  # a list: each call's storages, in order
        self.mark_calls = False  # each call and step a profiler range (GRAPH_CALL_PREFIX + label, STEP_RANGE)

    def wrap(self, boxed: Callable, label: str) -> Callable:
        """``boxed`` (aot's boxed calling convention: one list argument) with a time stamp."""
        def call(args):
            events = self.events
            if events is None:
                return boxed(args)
            started = time.perf_counter()
            if self.call_storages is not None:  # inside the call's time: the gaps stay the model's own
                # _cdata: the storage's C++ object's address (private): equal for views of one storage
                self.call_storages.append(frozenset(a.untyped_storage()._cdata for a in args
                                                    if isinstance(a, torch.Tensor)))
            body = time.perf_counter()  # the call's own time starts here (``StepCalls.calls_us``)
            try:
                if self.mark_calls:
                    with torch.autograd.profiler.record_function(GRAPH_CALL_PREFIX + label):
                        return boxed(args)
                return boxed(args)
            finally:
                events.append((label, started, time.perf_counter(), body))
        call._boxed_call = True
        return call


def step_calls(events: list[tuple], started: float, ended: float) -> StepCalls:
    """The calls in start order, the µs of host time before each and after the last, and the µs
    each call took (from its own start, ``SubgraphClock.events``' fourth field where given)."""
    ordered = sorted(events, key=lambda e: e[1])
    gaps = [max(0.0, high - low) * 1e6 for low, high in gap_bounds(ordered, started, ended)]
    took = tuple((end - (body[0] if body else start)) * 1e6 for _, start, end, *body in ordered)
    return StepCalls(tuple(e[0] for e in ordered), tuple(gaps[:-1]), gaps[-1], calls_us=took)


# Steps that compile (a recompilation after the first call changed a value dynamo guards on)
# run beyond warmup + rounds before the measurement gives up on a steady step
COMPILING_STEPS = 3
# A warm-up step over the budget is kept as the sample only where its host time outside the
# graphs is under this share of the step: a cold step's gaps read up to 1.7x a steady step's
# (eager LSTMs after a build), which matters where the gaps are most of the step.
COLD_SAMPLE_MAX_GAP_SHARE = 0.25
# A short step is sampled beyond ``rounds`` until this many seconds are spent (at most
# MAX_SAMPLES): the first steps after a build run slower than the later ones, and the samples'
# spread is the prediction's range.
SAMPLE_FILL_S = 0.05
MAX_SAMPLES = 20


def measure_host_gaps(step: Callable[[], object], clock: SubgraphClock, rounds: int = 3,
                      warmup: int = 1, budget_s: float = 1.0,
                      modules_of: torch.nn.Module | None = None, fill_s: float = 0.0,
                      compiling_steps: int = COMPILING_STEPS,
                      between: Callable[[], None] | None = None) -> StepCalls | None:
    """Run ``step`` ``warmup + rounds`` times (more where ``fill_s`` asks) with the graph calls
    time-stamped; the median step.

    A step during which the session compiled a graph is never a sample (its host time is the
    compiler's) nor a warm-up; None where every step compiled, or more than ``compiling_steps``.
    Stops early once ``budget_s`` is spent (with one sample at least). A warm-up step that alone
    took longer than the budget is the sample where its gaps are a small share of it
    (``COLD_SAMPLE_MAX_GAP_SHARE``: a large model, whose further steps would cost seconds of
    build time for little); where the gaps are most of the step (eager code between graphs) one
    steady step is measured after it. Short steps are sampled beyond ``rounds`` until ``fill_s``
    seconds are spent (at most ``MAX_SAMPLES``). ``modules_of``: the warm-up steps time that
    model's module calls and name the modules that ran in each gap (``StepCalls.gap_layers``);
    such a step is never a sample. ``between``: run before each step, outside its time (the
    example's cache object put back)."""
    samples, steady, compiled, named = [], 0, 0, None
    begun = time.perf_counter()
    try:
        for _ in range(warmup + (max(rounds, MAX_SAMPLES) if fill_s else rounds) + compiling_steps):
            clock.events = []
            compilations = clock.compilations
            naming = modules_of is not None and steady < warmup
            if between is not None:
                between()
            with module_calls(modules_of) if naming else contextlib.nullcontext([]) as modules:
                started = time.perf_counter()
                step()
                ended = time.perf_counter()
            if clock.compilations != compilations:
                compiled += 1
                if compiled > compiling_steps:
                    return None
                continue
            steady += 1
            sample = step_calls(clock.events, started, ended)
            if naming:
                named = (sample.calls, gap_layers(clock.events, modules, started, ended))
            if steady > warmup or (not naming and _cold_sample_will_do(sample, ended - started, budget_s)):
                samples.append(sample)
            if _enough(len(samples), ended - begun, rounds, budget_s, fill_s):
                break
    finally:
        clock.events = None
    if not samples:
        return None
    measured = StepCalls.median(samples)
    return dataclasses.replace(measured, gap_layers=named[1]) if named and named[0] == measured.calls else measured


def _enough(samples: int, spent_s: float, rounds: int, budget_s: float, fill_s: float) -> bool:
    """Whether ``measure_host_gaps`` has sampled enough steps: ``rounds`` of them once ``fill_s``
    is spent (or ``MAX_SAMPLES``), or any once the budget is."""
    filled = spent_s >= fill_s or samples >= MAX_SAMPLES
    return (samples >= rounds and filled) or (samples > 0 and spent_s > budget_s)


def _cold_sample_will_do(sample: StepCalls, step_s: float, budget_s: float) -> bool:
    """Whether a warm-up step is kept as the sample: it took the whole budget, and its gaps
    are too small a share of it for a cold step to move the prediction much."""
    return step_s > budget_s and sample.total_us < COLD_SAMPLE_MAX_GAP_SHARE * step_s * 1e6


def measure_model_gaps(call: Callable, model, inputs: tuple, training: bool, clock: SubgraphClock,
                       rounds: int = 3, warmup: int = 1,
                       anchors: Mapping[int, tuple[str, str]] | None = None,
                       named: bool = False, budget_s: float = 1.0,
                       fill_s: float = SAMPLE_FILL_S, compiling_steps: int = COMPILING_STEPS) -> StepCalls | None:
    """``measure_host_gaps`` of one call of ``call`` (the compiled model) on ``inputs``: under
    no_grad in inference; in training forward + backward (``seeded_step``) from cleared
    gradients. The model's gradients, buffers and RNG are left as they were. The result holds
    the storages the graph calls took (``StepCalls.input_storages``) and, by ``anchors`` (graph
    index → where its frame sits in the model and a parameter's path below it:
    ``layers.frame_anchor``), the block each call of a graph shared by the instances of a block
    ran on (``StepCalls.call_layers``). ``named``: the warm-up step names the modules that ran in
    each gap (``StepCalls.gap_layers``), for a model with eager code between its graphs. Short
    steps are sampled for ``fill_s`` seconds."""

    one = seeded_step(call, inputs, training)

    def step():
        if training:
            for p in model.parameters():
                p.grad = None
        # while eager ops are recorded, the step is a profiler range: the state kept around it is no op of the model's
        with torch.autograd.profiler.record_function(STEP_RANGE) if clock.mark_calls else contextlib.nullcontext():
            return one()

    clock.call_storages = []
    restore = python_objects_restorer(call_values(model, inputs))  # each step sees the example's cache object
    try:
        with preserved_state(model):
            measured = measure_host_gaps(step, clock, rounds, warmup, budget_s, modules_of=model if named else None,
                                         fill_s=fill_s, compiling_steps=compiling_steps, between=restore)
        per_call = tuple(clock.call_storages)
    finally:
        clock.call_storages = None
        restore()
    if measured is None:
        return None
    last_step = per_call[len(per_call) - len(measured.calls):] if len(per_call) >= len(measured.calls) else ()
    return dataclasses.replace(measured, input_storages=frozenset().union(*per_call),
                               call_layers=call_layers(measured.calls, last_step, model, anchors or {}))


def call_layers(calls: tuple[str, ...], storages: tuple, model, anchors: Mapping) -> tuple:
    """Per forward call of ``calls`` ("g0.fw"), (the block its graph's layers are named for, the
    block this call ran on) where they differ, else None: the parameter the graph was placed by
    (``anchors``) is found, by its path below the block, among the storages the call took."""
    if len(storages) != len(calls):
        return ()
    names = {t.untyped_storage()._cdata: name for name, t in [*model.named_parameters(), *model.named_buffers()]}
    layers = []
    for label, taken in zip(calls, storages):
        anchor = anchors.get(int(label[1:].split(".")[0])) if label.endswith(".fw") else None
        found = None
        if anchor is not None:
            block, below = anchor
            found = next((names[s][: -len(below) - 1] for s in taken
                          if s in names and names[s].endswith("." + below)), None)
        layers.append((anchor[0], found) if found is not None and found != anchor[0] else None)
    return tuple(layers)


def describe_gaps(step: StepCalls, subgraphs: int, training: bool, graph_breaks: int = 0) -> tuple[str, ...]:
    """Report lines: how much host time was measured outside the graphs, and repeated graphs."""
    eager = subgraphs > 1 or graph_breaks > 0
    graphs = f"the {subgraphs} captured graphs" if subgraphs > 1 else "the captured graph"
    causes = ([f"eager code around {graphs}"] if eager else []) + (["autograd"] if training else [])
    causes = causes or ["the module's call around its graph"]
    lines = (f"measured host time outside the graphs ({', '.join(causes)}): "
             f"{step.total_us / 1e3:.3f} ms per step, simulated as host tasks",)
    return lines + describe_calls(step)


def describe_calls(step: StepCalls) -> tuple[str, ...]:
    """A report line for graphs ``step`` called more than once, each simulated once per call."""
    repeated = {label: n for label, n in step.counts().items() if n > 1}
    return (f"graphs called more than once per step, simulated once per call: {repeated}",) if repeated else ()
