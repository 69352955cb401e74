"""Capture a model as ATen-level forward (+ backward) FX graphs, one set per dynamo subgraph.

torch.compile's dynamo front end splits the model at graph breaks; for each piece our
backend calls aot_autograd, which hands us the forward graph and, on the first
backward, the backward graph. ``CaptureSession`` is that backend: it annotates
layers, lets an optional transform (the pass pipeline) rewrite each graph, and keeps
what it saw so reports and simulations can read it.
"""
from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.fx as fx
from functorch.compile import aot_module_simplified, make_boxed_func

from .annotate import (LAYER, PARAMETER_GRADIENTS, ROOT_LAYER_LABEL, annotate_backward, annotate_forward,
                       frame_prefix, is_compute, node_flops, op_name, qualified_name)
from .dynamo_glue import compiling_code, describe_error, graph_break_counts, new_graph_breaks
from .host_gaps import SubgraphClock, describe_gaps, measure_model_gaps, worth_measuring
from .dead_copies import drop_dead_copies
from .inference_trace import boxed_caller, inference_graph
from .graph_guards import captured_if_rewrite_raises, same_state_or, weights_as_built_or
from .direct_calls import call_ops_directly
from .rnn_op import keep_ops_whole, outside_keep_ops_whole
from .sim.op_keys import size_hint
from .model_state import preserved_inputs, preserved_modes, preserved_state, switch_to_build_mode

GraphTransform = Callable[[fx.GraphModule, str, int, dict, object], fx.GraphModule]
"""(graph_module, phase "fw"|"bw", subgraph index, {placeholder: model tensor},
real forward inputs or None) → graph_module to run."""


class CaptureError(RuntimeError):
    """Nothing could be captured; the message says why."""


@dataclass(frozen=True)
class LayerStats:
    layer: str
    forward_ops: int
    backward_ops: int
    forward_flops: int
    backward_flops: int


@dataclass(frozen=True)
class Captured:
    """One dynamo subgraph: its ATen forward and (in training) backward graphs.

    ``forward``/``backward`` are the graphs as captured (before any pass); every
    compute node has ``meta["layer"]`` and ``meta["val"]`` (a fake tensor).
    """
    index: int
    forward: fx.GraphModule
    backward: fx.GraphModule | None
    torch_graph: fx.GraphModule
    training: bool
    input_shapes: tuple
    unmapped_backward_nodes: int = 0
    # the real tensors the forward graph received at capture (parameters, buffers, inputs):
    # what in-context profiling runs the graphs on
    example_inputs: tuple = field(default=(), repr=False, compare=False)
    # positions in ``example_inputs`` that hold the model's parameters or buffers
    state_positions: frozenset = frozenset()

    def graphs(self) -> tuple[tuple[str, fx.GraphModule], ...]:
        pairs = [("fw", self.forward)]
        if self.backward is not None:
            pairs.append(("bw", self.backward))
        return tuple(pairs)

    def layers(self) -> tuple[LayerStats, ...]:
        """Per layer, in forward order: op counts and FLOPs of forward and backward."""
        order: dict[str, list[int]] = {}
        for phase, gm in self.graphs():
            offset = 0 if phase == "fw" else 1
            for node in gm.graph.nodes:
                if not is_compute(node):
                    continue
                row = order.setdefault(node.meta.get(LAYER, ""), [0, 0, 0, 0])
                row[offset] += 1
                row[2 + offset] += node_flops(node)
        return tuple(LayerStats(layer, *row) for layer, row in order.items())

    def total_flops(self) -> int:
        return sum(s.forward_flops + s.backward_flops for s in self.layers())

    def summary(self, top: int | None = None) -> str:
        """A table of layers (op counts, GFLOPs); ``top`` keeps the costliest N."""
        rows = list(self.layers())
        if top is not None:
            rows = sorted(rows, key=lambda s: -(s.forward_flops + s.backward_flops))[:top]
        head = f"subgraph {self.index}: {len(self.layers())} layers, " \
               f"{_count_compute(self.forward)} fw ops" + \
               (f", {_count_compute(self.backward)} bw ops" if self.backward is not None else "") + \
               f", {self.total_flops() / 1e9:.3f} GFLOP"
        width = max([len(ROOT_LAYER_LABEL)] + [len(r.layer) for r in rows])
        lines = [head, f"{'layer':<{width}}  {'fw ops':>6}  {'bw ops':>6}  {'fw GFLOP':>9}  {'bw GFLOP':>9}"]
        for r in rows:
            lines.append(f"{r.layer or ROOT_LAYER_LABEL:<{width}}  {r.forward_ops:>6}  {r.backward_ops:>6}"
                         f"  {r.forward_flops / 1e9:>9.4f}  {r.backward_flops / 1e9:>9.4f}")
        return "\n".join(lines)


def _count_compute(gm: fx.GraphModule) -> int:
    return sum(is_compute(n) for n in gm.graph.nodes)


def op_counts(gm: fx.GraphModule) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if is_compute(node):
            counts[op_name(node)] = counts.get(op_name(node), 0) + 1
    return counts


@dataclass
class _SubgraphRecord:
    """What the backend saw for one subgraph; mutable while compilation is under way."""
    index: int
    torch_graph: fx.GraphModule
    training: bool
    input_shapes: tuple
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    forward_layers: dict = field(default_factory=dict)
    unmapped_backward_nodes: int = 0
    compile_seconds: float = 0.0
    example_inputs: tuple = ()
    state_positions: frozenset = frozenset()
    code: object = None  # the function dynamo compiled this graph from (None: not through dynamo)

    def freeze(self) -> Captured:
        return Captured(self.index, self.forward, self.backward, self.torch_graph,
                        self.training, self.input_shapes, self.unmapped_backward_nodes,
                        self.example_inputs, self.state_positions)


def _shape_of(value) -> tuple | str:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape)
    return type(value).__name__


_MODEL_STATE = re.compile(r"_(parameters|buffers)_")  # dynamo's names for lifted module state


def _user_input_shapes(gm: fx.GraphModule, example_inputs: Sequence) -> tuple:
    """Shapes of the subgraph's inputs that are not the model's own parameters or buffers."""
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    return tuple(_shape_of(x) for name, x in zip(names, example_inputs)
                 if not isinstance(x, torch.nn.Parameter) and not _MODEL_STATE.search(name))


class CaptureSession:
    """A torch.compile backend that records the ATen graphs of every subgraph it compiles.

    ``transform`` (the pass pipeline) may return a rewritten graph to execute; the
    record keeps the graph as captured, the transform keeps its own results.
    """

    def __init__(self, model: torch.nn.Module | None, transform: GraphTransform | None = None):
        self.transform = transform
        self.records: list[_SubgraphRecord] = []
        self.clock = SubgraphClock()  # time-stamps graph calls while host gaps are measured
        self.notes: list[str] = []    # what the report should say about the capture itself
        self.state_names: dict[int, str] = {}  # a shared tensor keeps its first name
        # BatchNorm's kernel updates its running statistics without bumping their version; each
        # train-mode call bumps its count (which an eval graph does not take): watched with them
        self.batches_tracked: list[torch.Tensor] = []
        if model is not None:
            for name, tensor in list(model.named_parameters(remove_duplicate=False)) + \
                    list(model.named_buffers(remove_duplicate=False)):
                self.state_names.setdefault(id(tensor), name)
            self.batches_tracked = [b for name, b in model.named_buffers() if name.endswith("num_batches_tracked")]

    def __call__(self, gm: fx.GraphModule, example_inputs: Sequence, one_trace: bool = False) -> Callable:
        """Compile ``gm`` (a backend's call). ``one_trace``: in inference, for a graph whose inputs
        are plain tensors, trace it once (``inference_trace``) instead of through aot_autograd."""
        record = _SubgraphRecord(len(self.records), gm, torch.is_grad_enabled(),
                                 _user_input_shapes(gm, example_inputs))
        record.code = compiling_code()
        self.records.append(record)
        names = self.state_names or _state_names_from_sources(gm, example_inputs)
        prefix = frame_prefix(gm, example_inputs, names)
        # aot_module_simplified puts gm's own parameters and buffers (a graph traced by torch.fx
        # holds them; dynamo lifts them to inputs) before the inputs
        own = [*dict(gm.named_parameters(remove_duplicate=False)).values(),
               *dict(gm.named_buffers(remove_duplicate=False)).values()]
        state = own + [x if id(x) in names else None for x in example_inputs]
        record.example_inputs = tuple(x.detach() if isinstance(x, torch.Tensor) else size_hint(x)  # a dynamic
                                      for x in own + list(example_inputs))  # size: its value (timed runs take it)
        record.state_positions = frozenset(i for i, x in enumerate(state) if x is not None)
        parameter_positions = frozenset(range(len(own))) | {i for i, x in enumerate(state)
                                                            if isinstance(x, torch.nn.Parameter)}

        @outside_keep_ops_whole()
        def compile_forward(fw: fx.GraphModule, _inputs):
            started = time.perf_counter()
            call_ops_directly(fw, recompile=False)  # the passes' copies of it call ops directly
            record.forward_layers = annotate_forward(fw, prefix)
            if not record.training:
                dropped = drop_dead_copies(fw)
                if dropped:
                    self.notes.append(f"graph {record.index}: dropped {len(dropped)} copies of intermediates that "
                                      f"nothing else reads (aot_autograd makes them, e.g. one per eval-mode dropout)")
            record.forward = fw
            runnable = self._transformed(fw, "fw", record.index, _model_state_of(fw, state),
                                         record.example_inputs)
            if runnable is fw:
                fw.recompile()  # it runs: its own code calls ops directly too
            record.compile_seconds += time.perf_counter() - started
            frozen = runnable is not fw and not record.training  # inference: state may be constants
            run = same_state_or(runnable.forward, fw.forward, state, len(own)) if frozen else runnable.forward
            if frozen:
                run = weights_as_built_or(run, fw.forward, state + self.batches_tracked, lambda: self.notes.append(
                    f"graph {record.index}: the model's weights changed in place after the build (load_state_dict, "
                    f"an optimizer step, BatchNorm statistics from a call in train mode): it runs as captured from "
                    f"then on, reading them as they are; rebuild to fold and pack them again"))
                run = captured_if_rewrite_raises(run, fw.forward, lambda error: self._rewrite_failed(record, error))
            return self.clock.wrap(make_boxed_func(run), f"g{record.index}.fw")

        @outside_keep_ops_whole()
        def compile_backward(bw: fx.GraphModule, _inputs):
            started = time.perf_counter()
            call_ops_directly(bw, recompile=False)
            record.unmapped_backward_nodes = annotate_backward(bw, record.forward_layers, prefix)
            bw.graph.output_node().meta[PARAMETER_GRADIENTS] = parameter_positions
            record.backward = bw
            runnable = self._transformed(bw, "bw", record.index, {}, None)
            if runnable is bw:
                bw.recompile()
            record.compile_seconds += time.perf_counter() - started
            return self.clock.wrap(make_boxed_func(runnable.forward), f"g{record.index}.bw")

        with keep_ops_whole(gm):
            fw = _traced_once(gm, example_inputs) if one_trace and not record.training else None
            if fw is not None:
                return boxed_caller(compile_forward(fw, None), own)
            return aot_module_simplified(gm, example_inputs, fw_compiler=compile_forward,
                                         bw_compiler=compile_backward)

    def _rewrite_failed(self, record: _SubgraphRecord, error: Exception) -> None:
        failed = getattr(self.transform, "rewrite_failed", None)
        if failed is not None:
            failed(record.index, "fw", error)

    def _transformed(self, gm: fx.GraphModule, phase: str, index: int, state: dict, inputs) -> fx.GraphModule:
        if self.transform is None:
            return gm
        return self.transform(gm, phase, index, state, inputs)

    def captured(self) -> tuple[Captured, ...]:
        return tuple(r.freeze() for r in self.records if r.forward is not None)


def _traced_once(gm: fx.GraphModule, example_inputs: Sequence) -> fx.GraphModule | None:
    """``inference_graph``, or None (aot_autograd traces it) where that trace raised."""
    try:
        return inference_graph(gm, example_inputs)
    except Exception:  # an optimization of the capture: aot_autograd's trace is the reference
        return None


def _state_names_from_sources(gm: fx.GraphModule, example_inputs: Sequence) -> dict[int, str]:
    """Without the root model (a plain torch.compile backend), name state by dynamo's sources."""
    names = {}
    for node, value in zip([n for n in gm.graph.nodes if n.op == "placeholder"], example_inputs):
        if isinstance(value, torch.Tensor) and _MODEL_STATE.search(node.name):
            source = getattr(getattr(node.meta.get("grapharg"), "source", None), "name", None)
            names[id(value)] = qualified_name(source) if source else node.name
    return names


def _model_state_of(fw: fx.GraphModule, state: list) -> dict:
    """Forward placeholder name → the model's parameter/buffer it receives (aot keeps the order)."""
    placeholders = [n.name for n in fw.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(state):
        return {}  # aot added or removed inputs: do not guess
    return {name: t for name, t in zip(placeholders, state) if t is not None}


def differentiable_scalar(output) -> torch.Tensor | None:
    """A scalar whose backward reaches every output that requires grad (to trigger bw compile)."""
    leaves = [t for t in torch.utils._pytree.tree_leaves(output)
              if isinstance(t, torch.Tensor) and t.requires_grad]
    if not leaves:
        return None
    return sum(t.float().sum() for t in leaves)


def tracing_config(training: bool):
    """Inference: dynamo traces RNN modules (``allow_rnn``) instead of breaking the graph there:
    ``aten.lstm`` stays one op, exact, and in the graph the simulator sees. Training keeps the
    break: autograd's decomposed LSTM gradients differ from the fused kernel's (~1e-3 on GNMT).
    Applied while fxdream builds; a later recompile (new shape) breaks at the RNN as dynamo does
    by default, still correct (patching every call would cost ~30 µs)."""
    if training or not hasattr(torch._dynamo.config, "allow_rnn"):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(allow_rnn=True)


def one_step(call: Callable, inputs: tuple, training: bool):
    """``call(*inputs)``: under no_grad in inference; in training also a backward reaching every
    output that needs a gradient (none where nothing does). Returns the output."""
    if not training:
        with torch.no_grad():
            return call(*inputs)
    output = call(*inputs)
    scalar = differentiable_scalar(output)
    if scalar is not None:
        scalar.backward()
    return output


def run_once(compiled: Callable, model: torch.nn.Module, inputs: tuple, training: bool):
    """One forward (and backward in training) through ``compiled``, leaving no trace on the model."""
    with preserved_state(model), preserved_inputs(inputs), tracing_config(training):
        return one_step(compiled, inputs, training)


def capture(model: torch.nn.Module, example_inputs, training: bool = False):
    """Capture ``model`` at ``example_inputs``: a ``Captured``, or a tuple of them after graph breaks.

    The model's grads, buffers, RNG state and every submodule's train/eval flag are left as they
    were (during the capture, a model whose own flag is not ``training`` is switched whole:
    ``switch_to_build_mode``). Raises ``CaptureError`` when dynamo captured nothing.
    """
    return capture_with_host_gaps(model, example_inputs, training, measure=False)[0]


def capture_with_host_gaps(model: torch.nn.Module, example_inputs, training: bool = False,
                           measure: bool = True) -> tuple:
    """``capture``, plus (when ``measure`` and it is a training step or the graph broke) the
    graph calls and host time outside the graphs of a few steps: (captured, StepCalls or None, notes)."""
    from .validate import check_inputs, check_model
    check_model(model)
    inputs = check_inputs(example_inputs)
    with preserved_modes(model):
        switch_to_build_mode(model, training)
        return _capture(model, inputs, training, measure)


def _capture(model: torch.nn.Module, inputs: tuple, training: bool, measure: bool) -> tuple:
    session = CaptureSession(model)
    breaks_before, how = graph_break_counts(), "dynamo"
    try:
        from .blockwise import capture_after_nothing  # these import this module
        from .fx_capture import compile_model
        runner, how = compile_model(model, inputs, session, training)
        run_once(runner, model, inputs, training)
        if not session.captured():
            retried = capture_after_nothing(model, inputs, session, training, new_graph_breaks(breaks_before))
            runner = retried[0] if retried else runner
    except Exception as error:
        run_once(model, model, inputs, training)  # the model's own error, if eager fails too
        raise CaptureError(f"the capture of {type(model).__name__} ({how}) failed: {describe_error(error)}") from error
    captured = session.captured()
    step, notes = None, ()
    if not captured:
        reasons = "; ".join(new_graph_breaks(breaks_before)) or "dynamo produced no graph"
        raise CaptureError(f"nothing was captured from {type(model).__name__}: {reasons}")
    if measure and worth_measuring(training, len(captured)):
        step = measure_model_gaps(runner, model, inputs, training, session.clock)
        notes = describe_gaps(step, len(captured), training)
    return (captured[0] if len(captured) == 1 else captured), step, notes
