"""Capture a model as ATen-level forward (+ backward) FX graphs, one set per dynamo subgraph.

torch.compile's dynamo front end splits the model at graph breaks; for each piece our
backend calls aot_autograd, which hands us the forward graph and, on the first
backward, the backward graph. ``CaptureSession`` is that backend: it annotates
layers, lets an optional transform (the pass pipeline) rewrite each graph, and keeps
what it saw so reports and simulations can read it.
"""
from __future__ import annotations

import re
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.fx as fx
from functorch.compile import aot_module_simplified, make_boxed_func
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from fxdream.capturing.captured import Captured
from fxdream.capturing.constants import fold_input_free_values
from fxdream.capturing.dead_copies import drop_dead_copies
from fxdream.capturing.dynamo import compiling_code
from fxdream.capturing.host_gaps import SubgraphClock
from fxdream.capturing.inference_trace import boxed_caller, inference_graph
from fxdream.capturing.keywords import WithKeywords
from fxdream.capturing.layers import annotate_backward, annotate_forward, frame_anchor, qualified_name
from fxdream.ir.nodes import PARAMETER_GRADIENTS
from fxdream.ir.tensors import size_hint
from fxdream.ops.keep_whole import keep_ops_whole, outside_keep_ops_whole
from fxdream.runtime.boxed import boxed_runner
from fxdream.runtime.direct_calls import call_ops_directly
from fxdream.runtime.graph_guards import captured_if_rewrite_raises, same_state_or, weights_as_built_or
from fxdream.runtime.unused_outputs import UnusedOutputs, reached_returns

GraphTransform = Callable[[fx.GraphModule, str, int, dict, object], fx.GraphModule]
"""(graph_module, phase "fw"|"bw", subgraph index, {placeholder: model tensor},
real forward inputs or None) → graph_module to run."""


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
    # (the frame's place in the model, a parameter's path below it: ``layers.frame_anchor``)
    anchor: tuple[str, str] | None = None
    modes: tuple[bool, ...] = ()  # each module's ``training`` flag when it was compiled
    tracing_context: object = None  # a weak reference to dynamo's (aot_autograd's lazy backward keeps it)

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
        # layer names as the user's model has them: keyword flags wrap it as the submodule "model"
        self.root = "model" if isinstance(model, WithKeywords) else ""
        # BatchNorm's kernel updates its running statistics without bumping their version; each
        # train-mode call bumps its count (which an eval graph does not take): watched with them
        self.batches_tracked: list[torch.Tensor] = []
        self.modules = tuple(model.modules()) if model is not None else ()  # their train/eval flags
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
        record.modes = tuple(m.training for m in self.modules)
        context = torch._guards.TracingContext.try_get()
        record.tracing_context = None if context is None else weakref.ref(context)
        self.clock.compilations += 1
        self._note_recompilation(record)
        self.records.append(record)
        names = self.state_names or _state_names_from_sources(gm, example_inputs)
        record.anchor = frame_anchor(gm, example_inputs, names)
        prefix = record.anchor[0] if record.anchor else ""
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
        unused_outputs = UnusedOutputs()  # learns the forward's data flow once compiled (training only)

        @outside_keep_ops_whole()
        def compile_forward(fw: fx.GraphModule, _inputs):
            started = time.perf_counter()
            call_ops_directly(fw, recompile=False)  # the passes' copies of it call ops directly
            record.forward_layers = annotate_forward(fw, prefix, self.root)
            if not record.training:
                dropped = drop_dead_copies(fw)
                if dropped:
                    self.notes.append(f"graph {record.index}: dropped {len(dropped)} copies of intermediates that "
                                      f"nothing else reads (aot_autograd makes them, e.g. one per eval-mode dropout)")
            self._fold_input_free(fw, record.index, "forward")
            record.forward = fw
            if record.training:
                unused_outputs.track(*_returns_of_compiling(fw))
            # state the step itself updates (a counter buffer: aot_autograd copies its new value
            # in after the graph) is neither a constant a pass may take nor a change to watch for
            updated = _inputs_aot_updates()
            kept = [None if i in updated else t for i, t in enumerate(state)]
            runnable = self._transformed(fw, "fw", record.index, _model_state_of(fw, kept),
                                         record.example_inputs)
            if runnable is fw:
                fw.recompile()  # it runs: its own code calls ops directly too
            record.compile_seconds += time.perf_counter() - started
            frozen = runnable is not fw and not record.training  # inference: state may be constants
            run = same_state_or(runnable.forward, fw.forward, state, len(own)) if frozen else runnable.forward
            if frozen:
                # a BatchNorm in train mode within an eval model counts its own batches: the
                # graph's update, not a change
                own_updates = {id(t) for i, t in enumerate(state) if i in updated and t is not None}
                counts = [b for b in self.batches_tracked if id(b) not in own_updates]
                run = weights_as_built_or(run, fw.forward, kept + counts, lambda: self._weights_changed(record))
                if any(isinstance(t, torch.Tensor) and t.is_inference() for t in state):
                    self.notes.append(f"graph {record.index}: the model's tensors were made under "
                                      f"torch.inference_mode(), which keeps no version counters: a weight "
                                      f"changed in place after the build is not seen; rebuild after changing one")
                run = captured_if_rewrite_raises(run, fw.forward, lambda error: self._rewrite_failed(record, error))
            return self.clock.wrap(make_boxed_func(run), f"g{record.index}.fw")

        @outside_keep_ops_whole()
        def compile_backward(bw: fx.GraphModule, _inputs):
            started = time.perf_counter()
            self.clock.compilations += 1
            call_ops_directly(bw, recompile=False)
            record.unmapped_backward_nodes = annotate_backward(bw, record.forward_layers, prefix, self.root)
            bw.graph.output_node().meta[PARAMETER_GRADIENTS] = parameter_positions
            self._fold_input_free(bw, record.index, "backward")
            record.backward = bw
            runnable = self._transformed(bw, "bw", record.index, {}, None)
            if runnable is bw:
                bw.recompile()
            record.compile_seconds += time.perf_counter() - started
            run = boxed_runner(runnable)  # frees saved tensors early
            if unused_outputs.needed:
                run = unused_outputs.dropping(run)
            return torch._dynamo.disable(self.clock.wrap(run, f"g{record.index}.bw"))

        with keep_ops_whole(gm):
            fw = _traced_once(gm, example_inputs) if one_trace and not record.training else None
            if fw is not None:
                return boxed_caller(compile_forward(fw, None), own)
            # the backward is compiled at, and runs from, its first backward call: one a forward
            # makes (``torch.autograd.grad`` in an energy model's forward) runs while dynamo traces
            # that forward's frames, and dynamo would trace fxdream's code as the model's
            compiled = aot_module_simplified(gm, example_inputs, fw_compiler=compile_forward,
                                             bw_compiler=torch._dynamo.disable(compile_backward))
            if unused_outputs.needed:
                return unused_outputs.hooked(compiled)
            return compiled

    def _note_recompilation(self, record: _SubgraphRecord) -> None:
        """A graph compiled again from the same code for the same inputs is a recompilation: a
        value dynamo guards on differs from an earlier call's (a non-tensor argument, or an
        attribute forward sets on its first call, as Hugging Face classifiers set
        ``config.problem_type``). Said once; calls with that value run the new graph, and host
        time is never taken from a step that compiled (``measure_host_gaps``)."""
        if record.code is None:
            return
        earlier = next((r for r in self.records if r.code is record.code and r.input_shapes == record.input_shapes
                        and r.training == record.training), None)
        if earlier is None:
            return
        if earlier.modes != record.modes:
            cause = ("the model's train/eval mode differs from that graph's (model.train() / model.eval()); calls "
                     "in this mode")
        else:
            cause = ("a value dynamo guards on differs from an earlier call's (a non-tensor argument of the call, or "
                     "an attribute forward sets on its first call); calls with that value")
        self.notes.append(f"graph {record.index} recompiles graph {earlier.index} (same code, same input shapes): "
                          f"{cause} run graph {record.index}")

    def _fold_input_free(self, gm: fx.GraphModule, index: int, phase: str) -> None:
        folded = fold_input_free_values(gm)
        if folded:
            where = ", ".join(sorted(set(folded))[:3]) + (", ..." if len(set(folded)) > 3 else "")
            self.notes.append(f"graph {index}: {len(folded)} value(s) the {phase} computes from no input (in {where}) "
                              f"computed once at capture instead of on every call")

    def _weights_changed(self, record: _SubgraphRecord) -> None:
        self.notes.append(f"graph {record.index}: the model's weights changed in place after the build "
                          f"(load_state_dict, an optimizer step, BatchNorm statistics from a call in train mode): it "
                          f"runs as captured from then on, reading them as they are; rebuild to fold and pack them "
                          f"again")
        as_captured = getattr(self.transform, "runs_as_captured", None)
        if as_captured is not None:
            as_captured(record.index, "fw", "the model's weights changed in place after the build")

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

    def forget_real_tensors(self) -> None:
        """Drop the weak references the captures' fake modes hold to the real tensors they
        converted (the model's parameters among them): ``torch.utils.swap_tensors`` refuses a
        tensor something holds weakly, and with it ``load_state_dict`` and ``.to()`` under
        ``torch.__future__.set_swap_module_params_on_conversion(True)``. dynamo drops them (its
        tracing context's and its fake mode's) after compiling for its registered backends, not for
        a backend object such as this one. Only caches of conversions go: a later conversion of
        the same tensor makes a new fake."""
        graphs = [g for r in self.records for g in (r.torch_graph, r.forward, r.backward) if g is not None]
        for mode in {id(m): m for m in map(_fake_mode_of, graphs) if m is not None}.values():
            describer = mode.fake_tensor_converter.meta_converter.describer
            describer.lookup_tensor.clear()
            describer.lookup_storage.clear()
        for record in self.records:
            context = record.tracing_context() if record.tracing_context is not None else None
            if context is not None:
                context.tensor_to_context.clear()


def _fake_mode_of(gm: fx.GraphModule):
    """The fake mode of the first fake value a node of ``gm`` holds (one mode traces a graph)."""
    for node in gm.graph.nodes:
        for value in pytree.tree_leaves((node.meta.get("val"), node.meta.get("example_value"))):
            if isinstance(value, FakeTensor):
                return value.fake_mode
    return None


def _traced_once(gm: fx.GraphModule, example_inputs: Sequence) -> fx.GraphModule | None:
    """``inference_graph``, or None (aot_autograd traces it) where that trace raised."""
    try:
        return inference_graph(gm, example_inputs)
    except Exception:  # an optimization of the capture: aot_autograd's trace is the reference
        return None


def _inputs_aot_updates() -> frozenset[int]:
    """Positions of the graph inputs aot_autograd updates in place after the forward graph it is
    compiling (its metadata's ``mutates_data``); empty outside such a compilation (``_traced_once``
    traces only graphs that update none)."""
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    infos = getattr(metadata, "input_info", None) or ()
    return frozenset(i for i, info in enumerate(infos) if getattr(info, "mutates_data", False))


def _returns_of_compiling(fw: fx.GraphModule) -> tuple[tuple[frozenset[int], ...], frozenset[int], frozenset[int]]:
    """The forward graph aot_autograd is compiling: which of the Function's outputs (its metadata's
    mutated inputs, outputs and intermediate bases, in that order) each input reaches, which of
    them carry gradients and which inputs require one. Nothing where the metadata is not there,
    its inputs are not the graph's one for one, or the graph also threads effect tokens."""
    context = torch._guards.TracingContext.try_get()
    metadata = getattr(context, "fw_metadata", None)
    placeholders = sum(1 for n in fw.graph.nodes if n.op == "placeholder")
    if metadata is None or getattr(metadata, "tokens", None) or not hasattr(metadata, "num_forward_returns") \
            or len(metadata.input_info) != placeholders:  # (inputs deduplicated or added: positions unknown)
        return (), frozenset(), frozenset()
    returns = [metadata.input_info[i] for i in metadata.mutated_inp_runtime_indices] + list(metadata.output_info)
    differentiable = frozenset(i for i, info in enumerate(returns) if info.requires_grad) | \
        frozenset(range(len(returns), metadata.num_forward_returns))  # intermediate bases
    requiring_gradients = frozenset(i for i, info in enumerate(metadata.input_info) if info.requires_grad)
    return reached_returns(fw, metadata.num_forward_returns), differentiable, requiring_gradients


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


