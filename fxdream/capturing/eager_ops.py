"""The eager ATen ops a step runs between its compiled graphs, as graphs a prediction can cost.

Where nothing is measured (a prediction for another device, a model on the meta device), the
code between the graphs (a function dynamo skips, ``torch.compiler.disable``, the backward of
eager code) has no time. Its ops are recorded instead: the step runs once under torch's
profiler with its shapes (``record_shapes``), each graph call inside a ``record_function``
range named by its label, and every top-level ATen op outside those ranges (one whose caller
is no ATen op or prim) is replayed on the meta device (``fxdream.capturing.op_replay``). The
ops run before each graph call form graphs of independent ops (each op's inputs are its own
placeholders: the profiler records no data flow), one per phase in the order they ran (the
forward's, then the backward's, which autograd's engine runs), lowered like a captured graph
and costed by the same model.

An RNN layer whose backward ran is replayed as one op where its forward ran and its backward
as one op where that ran, not as the per-step nodes the engine ran; the loss a training step
backpropagates is fxdream's, not the model's, and left out. An op that cannot be replayed (an
argument the profiler does not record: ``index``'s list of optional tensors) is counted by
name instead (``StepCalls.eager_skipped``), and said in the notes.
"""
from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import sys
from typing import Callable, Mapping, NamedTuple

import torch
import torch.fx as fx

from fxdream.capturing.gap_layers import on_module_calls
from fxdream.capturing.host_gaps import (
    END,
    GRAPH_CALL_PREFIX,
    STEP_RANGE,
    StepCalls,
    SubgraphClock,
    measure_model_gaps,
)
from fxdream.capturing.meta import on_meta
from fxdream.capturing.op_replay import ALL, BACKWARD, FORWARD, HOST_READ_RANGE, WHOLE_LAYERS, replay
from fxdream.capturing.steps import LOSS_RANGE
from fxdream.ir.nodes import LAYER

ENGINE_NODE = "autograd::engine::evaluate_function"  # the engine's range around running one node
MAX_OPS = 5000  # a step that is mostly eager code: the first ops are replayed, the rest counted
LAYER_RANGE = "fxdream.layer:"  # an eager module call's profiler range while eager ops are recorded: this + its name
HOST_READ_METHODS = ("tolist", "cpu")  # tensor methods that copy it to the host without an ATen op of their own


def record_model_calls(call: Callable, model, inputs: tuple, training: bool, clock: SubgraphClock,
                       anchors: Mapping[int, tuple[str, str]] | None = None) -> StepCalls | None:
    """The order of the graph calls of one step of ``call`` (as ``measure_model_gaps`` runs it),
    without times (``StepCalls.measured`` False, gaps zero), with the eager ops between them
    (``StepCalls.eager_before``) and the storages the calls took; None where every step
    compiled. For a prediction that measures nothing here. On the meta device a value read on
    the host is a CPU tensor's (a meta tensor has none to read): no wait for the device.
    ``anchors``: graph index → where its frame sits in the model and a parameter's path below it
    (``layers.frame_anchor``), by which each call of a graph shared by the instances of a block
    is placed at its own block (``StepCalls.call_layers``)."""
    clock.mark_calls = True
    try:
        with profiled() as events, python_ranges(model):
            step = measure_model_gaps(call, model, inputs, training, clock, rounds=1, warmup=0, anchors=anchors,
                                      fill_s=0.0)
    finally:
        clock.mark_calls = False
    if step is None:
        return None
    before, skipped = eager_ops(events, len(step.calls), reads_wait=not on_meta(model, inputs))
    return dataclasses.replace(step, gaps_us=(0.0,) * len(step.calls), end_us=0.0, measured=False,
                               eager_before=before, eager_skipped=skipped)


@contextlib.contextmanager
def profiled():
    """The body under torch's profiler with shapes; yields a list that holds its events after.

    The process's standard error is closed meanwhile: torch's profiler writes two lines of its
    own there at every start and stop, which a user of a prediction has no use for. The body is
    a step that already ran once, whose warnings were shown then."""
    events: list = []
    sys.stderr.flush()
    saved, quiet = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(quiet, 2)
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True) as profile:
            yield events
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(quiet)
    events.extend(profile.events())


@contextlib.contextmanager
def python_ranges(model: torch.nn.Module):
    """What the profiler cannot see of the body's Python, as profiler ranges: each call of one
    of ``model``'s submodules that runs as Python (eagerly) a range named ``LAYER_RANGE`` + its
    qualified name; each copy of a tensor to the host by a method that records no op of its own
    (``HOST_READ_METHODS``: ``.tolist()``, ``.cpu()``) a ``HOST_READ_RANGE`` around an alias
    of the tensor (its shape and dtype). Opened and closed by ``on_module_calls``'s profile
    function; nothing where a profile function is set already (a user's profiler keeps it)."""
    # record_function's own ops (private, isolated here): a range opened in one call, closed in another
    open_range, close_range = torch.ops.profiler._record_function_enter_new, torch.ops.profiler._record_function_exit

    def read_on_host(function) -> None:
        tensor = getattr(function, "__self__", None)
        if getattr(function, "__name__", None) in HOST_READ_METHODS and isinstance(tensor, torch.Tensor):
            handle = open_range(HOST_READ_RANGE, None)
            torch.ops.aten.alias(tensor)  # recorded with the tensor's shape and dtype
            close_range._RecordFunction(handle)
    with on_module_calls(model, lambda name: open_range(LAYER_RANGE + name, None), close_range._RecordFunction,
                         read_on_host):
        yield


def eager_ops(events: list, calls: int, reads_wait: bool = True) -> tuple[dict, dict[str, int]]:
    """(position k → the eager ops run before graph call k, ``END`` → after the last, as
    (phase, graph) pairs in the order they ran; op name → ops not replayed) of a profiled step
    (the last ``STEP_RANGE``, where there is one) whose ``calls`` graph calls were ranges named
    ``GRAPH_CALL_PREFIX`` + label. Where the ranges do not match the calls (a step that
    compiled), every eager op is put at the end. ``reads_wait``: a value read on the host is a
    device tensor's, for which the host waits (``op_replay.replay``). Each op's nodes are the layer
    of the innermost module range (``python_ranges``) it ran in; a backward op's, that of the
    forward op whose node autograd's engine ran."""
    skipped: collections.Counter = collections.Counter()
    before, replayed, cache = {}, 0, {}
    for key, ran in _eager_events(events, calls).items():
        segments: list[tuple[str, fx.Graph]] = []
        for op in ran:
            if not segments or segments[-1][0] != op.phase:
                segments.append((op.phase, fx.Graph()))
            if replayed >= MAX_OPS:
                skipped[op.event.name] += 1
                continue
            graph = segments[-1][1]
            known = set(graph.nodes)
            added, missed = replay(graph, op.event, cache, op.part, reads_wait)
            for node in graph.nodes:
                if node not in known and node.op == "call_function":
                    node.meta[LAYER] = op.layer
            replayed += added
            skipped.update(missed)
        kept = tuple((phase, _module(graph)) for phase, graph in segments
                     if any(n.op == "call_function" for n in graph.nodes))
        if kept:
            before[key] = kept
    return before, dict(skipped)


def _module(graph: fx.Graph) -> fx.GraphModule:
    graph.output(())
    return fx.GraphModule(torch.nn.Module(), graph)


class _EagerOp(NamedTuple):
    """An op to replay: when it ran, in which phase, and which part of its replay."""
    start: float
    end: float
    phase: str  # "fw", or "bw" for an op autograd's engine ran
    event: object
    part: str = ALL
    layer: str = ""  # the module it ran in (a backward op: its forward op's); "" where none is known


def _eager_events(events: list, calls: int) -> dict[object, list[_EagerOp]]:
    """The model's eager top-level ATen ops grouped by the graph call they precede, in the order
    they ran: inside the step, outside every graph call, the loss fxdream makes and the backward
    nodes of that loss; an RNN layer whose backward ran as its forward where it ran and its
    backward where that began, in place of the per-step nodes the engine ran. Each with its
    layer (``_layers``)."""
    steps = [(e.time_range.start, e.time_range.end) for e in events if e.name == STEP_RANGE]
    first, last = max(steps) if steps else (float("-inf"), float("inf"))  # the last step: the one kept
    calls_ran = sorted(((e.time_range.start, e.time_range.end) for e in events
                        if e.name.startswith(GRAPH_CALL_PREFIX) and first <= e.time_range.start <= last),
                       key=lambda r: r[0])
    layers_backward, layer_nodes = _rnn_layers_trained(events)
    loss = [e for e in events if e.name == LOSS_RANGE]
    loss_numbers = {d.sequence_nr for e in loss for d in _descendants(e) if d.sequence_nr >= 0}
    outside = calls_ran + layer_nodes + [(e.time_range.start, e.time_range.end) for e in loss] + \
        _backward_of(loss_numbers, events)
    ran = []
    kept = [e for e in events if _top_level_aten(e) and first <= e.time_range.start <= last
            and not any(s <= e.time_range.start < end for s, end in outside)]
    layer_of = _layers(kept)
    for event in kept:
        start, end, layer = event.time_range.start, event.time_range.end, layer_of.get(id(event), "")
        if id(event) not in layers_backward:
            ran.append(_EagerOp(start, end, "bw" if _engine_node(event) is not None else "fw", event, layer=layer))
            continue
        ran.append(_EagerOp(start, end, "fw", event, FORWARD, layer))
        ran.append(_EagerOp(*layers_backward[id(event)], "bw", event, BACKWARD, layer))
    grouped: dict[object, list[_EagerOp]] = collections.defaultdict(list)
    for op in sorted(ran, key=lambda op: op.start):
        following = next((k for k, (s, _) in enumerate(calls_ran) if s >= op.end), None)
        grouped[following if len(calls_ran) == calls and following is not None else END].append(op)
    return grouped


def _rnn_layers_trained(events: list) -> tuple[dict[int, tuple[float, float]], list[tuple[float, float]]]:
    """(id of each RNN layer event (``WHOLE_LAYERS``) whose backward ran → (start, end) of that
    backward, the time ranges of every such layer's backward nodes). On the meta device an RNN
    layer runs as per-step ops, each recording its own autograd node, whose backward then runs
    node by node: those nodes are told by their sequence numbers (the forward op's, on the
    engine's ``evaluate_function`` range), left out, and the layer's backward replayed as one op
    (``lstm_train_backward``)."""
    layers = {}
    for event in events:
        if event.name in WHOLE_LAYERS and _top_level_aten(event):
            layers[id(event)] = {d.sequence_nr for d in _descendants(event) if d.sequence_nr >= 0}
    if not layers:
        return {}, []
    nodes_by_number = collections.defaultdict(list)  # the engine's node ranges by forward op
    for e in events:
        if e.name.startswith(ENGINE_NODE):
            nodes_by_number[e.sequence_nr].append((e.time_range.start, e.time_range.end))
    backward = {}
    for layer, numbers in layers.items():
        ranges = [r for number in numbers for r in nodes_by_number.get(number, ())]
        if ranges:
            backward[layer] = (min(s for s, _ in ranges), max(e for _, e in ranges))
    return backward, [r for number in set().union(*layers.values()) for r in nodes_by_number.get(number, ())]


def _engine_node(event):
    """The range of autograd's engine running the backward node ``event`` is an op of; None for
    an op the engine did not run."""
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(ENGINE_NODE):
            return parent
        parent = parent.cpu_parent
    return None


def _layers(ops: list) -> dict[int, str]:
    """id of each op of ``ops`` → the qualified name of the innermost module range it ran in
    (``python_ranges``); an op autograd's engine ran takes the layer of the forward op that
    recorded its node (the node's sequence number)."""
    found, by_number = {}, {}
    for op in ops:
        parent = op.cpu_parent
        while parent is not None and not parent.name.startswith(LAYER_RANGE):
            parent = parent.cpu_parent
        if parent is not None:
            found[id(op)] = parent.name[len(LAYER_RANGE):]
            for part in [op, *_descendants(op)]:
                if part.sequence_nr >= 0:
                    by_number[part.sequence_nr] = found[id(op)]
    for op in ops:
        node = _engine_node(op)
        if node is not None and node.sequence_nr in by_number:
            found[id(op)] = by_number[node.sequence_nr]
    return found


def _backward_of(sequence_numbers: set[int], events: list) -> list[tuple[float, float]]:
    """The time ranges in which autograd's engine ran the nodes the forward ops numbered
    ``sequence_numbers`` recorded (their backward)."""
    return [(e.time_range.start, e.time_range.end) for e in events
            if e.name.startswith(ENGINE_NODE) and e.sequence_nr in sequence_numbers]


def _descendants(event) -> list:
    found, todo = [], list(event.cpu_children)
    while todo:
        child = todo.pop()
        found.append(child)
        todo.extend(child.cpu_children)
    return found


# callers whose ATen ops are not the model's eager code: an op (its parts), the engine's gradient
# hand-over, aot_autograd's runtime wrapper around a compiled graph (costed as the graph's call)
NOT_MODEL_CALLERS = ("aten::", "prims::", "torch::autograd::AccumulateGrad", "CompiledFunction")


def _top_level_aten(event) -> bool:
    parent = event.cpu_parent
    return event.name.startswith("aten::") and not (parent is not None and parent.name.startswith(NOT_MODEL_CALLERS))
