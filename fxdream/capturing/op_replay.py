"""One ATen op recorded by torch's profiler, replayed on meta tensors as the ops a graph holds.

``replay(graph, event, cache, part)`` adds the op to an FX graph: traced by ``make_fx`` from the
recorded overload, shapes, dtypes and values (a composite op splits into the ops a captured graph
holds: ``linear`` into ``t`` and ``addmm``), each input a placeholder of its own (the profiler
records no data flow). Three kinds of op need more than their record:

* An RNN layer (``WHOLE_LAYERS``) is the one op a captured graph holds (``keep_ops_whole``),
  not its per-step ops; over a packed sequence, the padded layer of the same steps and rows.
  An RNN cell (``WHOLE_CELLS``) is one op in inference, as in an inference graph.
  Where its backward ran it is traced with it, and the forward and backward parts are added
  where each ran (``part``).
* A composite op whose output's size follows values (packing a sequence) is replayed as the
  ATen ops it ran, which the profiler records with their shapes.
* A host read of a device value (``.item()``) is the copy to the host the lowering follows with
  a wait for the device.
* An op whose record lacks what its replay needs stands in as one of the same work
  (``stand_in``): indexing with tensors as the copy of the tensor it reads or writes.
"""
from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.fx as fx
import torch.fx.experimental._config as meta_config  # private; the only switch of the meta nonzero kernel
from torch.fx.experimental.proxy_tensor import make_fx

from fxdream.ops.keep_whole import keep_ops_whole

# the profiler's names of tensor dtypes (c10's type names)
DTYPES = {"float": torch.float32, "double": torch.float64, "c10::Half": torch.float16,
          "c10::BFloat16": torch.bfloat16, "long int": torch.int64, "int": torch.int32, "short int": torch.int16,
          "signed char": torch.int8, "unsigned char": torch.uint8, "bool": torch.bool}
SCALAR_TYPES = {0: torch.uint8, 1: torch.int8, 2: torch.int16, 3: torch.int32, 4: torch.int64, 5: torch.float16,
                6: torch.float32, 7: torch.float64, 11: torch.bool, 15: torch.bfloat16}
# ops the replay of a layer with its backward makes itself (the gradients flowing in, autograd's
# detaches): inputs of the layer's backward, not ops the step ran; the first ones_like is where
# the backward begins
REPLAY_HARNESS = (torch.ops.aten.ones_like.default, torch.ops.aten.detach.default, torch.ops.aten.zeros.default)
# ops that read a device tensor's value on the host: the host waits for the device there
HOST_READS = ("aten::item", "aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal")
# the profiler's range around the ``aten::alias`` of a tensor a method that records no op of its
# own copied to the host (``.tolist()``, ``.cpu()``: ``eager_ops.python_ranges``): a read too
HOST_READ_RANGE = "fxdream.host_read"
# RNN layers replayed as the torch function nn.RNNBase calls, which keep_ops_whole keeps one op
WHOLE_LAYERS = {"aten::lstm": torch._VF.lstm, "aten::gru": torch._VF.gru, "aten::rnn_tanh": torch._VF.rnn_tanh,
                "aten::rnn_relu": torch._VF.rnn_relu}
# RNN cells replayed as the torch function nn's cells call, which keep_ops_whole keeps one op in
# inference (``rnn_cell_inference``), as a captured inference graph holds a cell
WHOLE_CELLS = {f"aten::{name}": getattr(torch._VF, name) for name in
               ("lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell")}
# indexing ops (a list of optional index tensors, recorded with no shapes) → the argument whose
# copy stands in for their work: the indexed tensor's for a read, the values' for a write
INDEXING = {"aten::index": 0, "aten::index_put_": 2, "aten::index_put": 2, "aten::_index_put_impl_": 2}
# which of an op's replay to add: all of it; or of a layer traced with its backward, either part
ALL, FORWARD, BACKWARD = "all", "forward", "backward"


def replay(graph: fx.Graph, event, cache: dict, part: str = ALL, reads_wait: bool = True) -> tuple[int, list[str]]:
    """(ops added to ``graph``, names of those not replayed): ``event``'s op (``part``: ``ALL``,
    or ``FORWARD``/``BACKWARD`` of an RNN layer whose backward ran); or, where it cannot be
    replayed from its own record and is a composite op (``_composite``), the ATen ops it ran,
    each likewise: ``_pad_packed_sequence`` copies a step's rows at a time, in ops whose shapes
    the profiler records where its own output's size follows the lengths' values. ``cache``
    keeps each recorded call's trace, as an eager loop repeats the same calls. ``reads_wait``:
    a value read on the host is a device tensor's (``_host_read_into``); else a CPU tensor's,
    which costs the device nothing."""
    if _host_read(event):
        if not reads_wait:
            return 0, []
        if _host_read_into(graph, event):
            return 1, []
    if _replay_into(graph, event, cache, part):
        return 1, []
    parts = sorted((c for c in event.cpu_children if c.name.startswith("aten::")), key=lambda c: c.time_range.start)
    if part != ALL or not parts or not _composite(event):
        return 0, [event.name]
    added, missed = 0, []
    for child in parts:
        child_added, child_missed = replay(graph, child, cache, reads_wait=reads_wait)
        added, missed = added + child_added, missed + child_missed
    return added, (missed if added else [event.name])  # none of its parts: named as the op the model called


def _host_read(event) -> bool:
    """Whether ``event`` reads a tensor on the host: a ``HOST_READS`` op, or the alias marking a
    copy to the host (``HOST_READ_RANGE``)."""
    return event.name in HOST_READS or (event.cpu_parent is not None and event.cpu_parent.name == HOST_READ_RANGE)


def _host_read_into(graph: fx.Graph, event) -> bool:
    """Add a host read of a device value (``HOST_READS``: ``.item()``, ``bool(tensor)``; or a
    ``HOST_READ_RANGE``'s: ``.tolist()``, ``.cpu()``) to ``graph`` as the copy of its first
    tensor to the host (``_local_scalar_dense``), after which the lowering makes the host wait
    for the device; False for any other op. A meta tensor has no value to read, so such an op is
    never replayed. A step recorded on real data does not tell a tensor that stays on the host
    (a packed sequence's batch sizes) from a device tensor: every read waits, an upper bound; on
    the meta device only a CPU tensor can be read."""
    if not _host_read(event) or not event.input_dtypes or event.input_dtypes[0] not in DTYPES:
        return False
    read = graph.placeholder(f"eager_input_{len(graph.nodes)}")
    read.meta["val"] = torch.empty(event.input_shapes[0], dtype=DTYPES[event.input_dtypes[0]], device="meta")
    value = graph.call_function(torch.ops.aten._local_scalar_dense.default, (read,))
    value.meta["val"] = 0.0 if read.meta["val"].dtype.is_floating_point else 0  # a Python number, as item gives
    return True


def _composite(event) -> bool:
    """Whether ``event``'s op runs as other ATen ops on every device: each of its overloads that
    takes the recorded number of arguments has a composite kernel and none of its own for a CPU
    or a GPU (``aten::index`` has kernels of its own: its parts are not its work)."""
    namespace, _, name = event.name.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), name, None)
    if packet is None:
        return False
    names = [event.overload_name] if event.overload_name else packet.overloads()
    qualified = [f"{event.name}.{n}" if n != "default" else event.name for n in names
                 if hasattr(packet, n) and len(getattr(packet, n)._schema.arguments) == len(event.input_shapes)]

    def has(op: str, key: str) -> bool:
        try:
            return torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
        except RuntimeError:  # an overload only TorchScript holds (``index_put.hacked_twin``): no kernel
            return False
    return bool(qualified) and all(
        (has(op, "CompositeImplicitAutograd") or has(op, "CompositeExplicitAutograd"))
        and not (has(op, "CPU") or has(op, "CUDA")) for op in qualified)


def _replay_into(graph: fx.Graph, event, cache: dict, part: str) -> bool:
    """Add ``event``'s op, as make_fx splits it on meta tensors, to ``graph``: all of it, or the
    forward or backward ``part`` of a layer traced with its backward (a value the other part
    makes becomes an input); False where it cannot be replayed."""
    traced = _traced(event, cache, with_backward=part != ALL)
    if traced is None:
        return False
    nodes = list(traced.graph.nodes)
    backward_from = next((i for i, n in enumerate(nodes) if n.target is torch.ops.aten.ones_like.default),
                         len(nodes)) if part != ALL else len(nodes)
    env = {}

    def as_input(node: fx.Node, kind: str = "input") -> fx.Node:
        env[node] = graph.placeholder(f"eager_{kind}_{len(graph.nodes)}")
        env[node].meta.update(node.meta)
        return env[node]
    for i, node in enumerate(nodes):
        if part != ALL and (i < backward_from) != (part == FORWARD):
            continue
        if node.op == "placeholder" or (part != ALL and node.target in REPLAY_HARNESS):
            as_input(node)
        elif node.op == "call_function":
            env[node] = graph.node_copy(node, lambda n: env[n] if n in env else as_input(n))
        elif node.op == "get_attr":  # a constant make_fx kept: the op's input all the same
            as_input(node, "constant").meta["val"] = getattr(traced, node.target)
    return True


@dataclasses.dataclass(frozen=True)
class StandIn:
    """A recorded op in the form another op's replay takes: the profiler's fields, rewritten."""
    name: str
    overload_name: str
    input_shapes: list
    input_dtypes: list
    concrete_inputs: list
    structured_input_shapes: list


def packed_layer_stand_in(event):
    """``event``, or for an RNN layer over a packed sequence (``lstm.data``: ``data`` [N, F] and
    ``batch_sizes`` [T], from ``nn.utils.rnn.pack_padded_sequence``) a stand-in of the same
    work: the layer over a padded input of T steps of ceil(N / T) rows, with its states that
    wide. It runs T sequential steps over N rows in all; its own replay cannot run on meta
    tensors, as its steps' sizes follow the values of ``batch_sizes``."""
    dtypes = list(event.input_dtypes)
    is_packed = len(dtypes) == 9 and dtypes[1] == "long int" and len(event.input_shapes[1]) == 1
    if event.name not in WHOLE_LAYERS or not is_packed:
        return event
    lists = list(getattr(event, "structured_input_shapes", None) or [None] * len(dtypes))
    (rows, features), (steps,) = event.input_shapes[0], event.input_shapes[1]
    width = -(-rows // max(steps, 1))
    widened = lambda shape: [shape[0], width, *shape[2:]]  # noqa: E731  (layers x directions, batch, hidden)
    states = [widened(s) for s in lists[2]] if dtypes[2] == "TensorList" else widened(event.input_shapes[2])
    shapes = [[steps, width, features]] + [[] if dtypes[2] == "TensorList" else states] + event.input_shapes[3:] + [[]]
    return StandIn(event.name, "input", shapes, [dtypes[0]] + dtypes[2:] + ["Scalar"],
                   [None] + list(event.concrete_inputs[2:]) + [False],
                   [shapes[0], states] + lists[3:] + [[]])


def stand_in(event):
    """``event``, or the op that stands in for it where its own replay cannot run on meta tensors:
    an RNN layer over a packed sequence (``packed_layer_stand_in``); ``masked_select`` (no meta
    kernel) as the ``nonzero`` of its mask, the read of the mask and the host's wait for the
    elements kept, whose copy it leaves out; an indexing op (``INDEXING``), whose indices the
    profiler records without shapes, as a copy of the one tensor it records: what ``x[i]``
    reads, what ``x[i] = v`` writes."""
    if event.name == "aten::masked_select" and len(event.input_shapes) == 2:
        return StandIn("aten::nonzero", "", [event.input_shapes[1]], [event.input_dtypes[1]], [None],
                       [event.input_shapes[1]])
    copied = INDEXING.get(event.name)
    if copied is not None and len(event.input_shapes) > copied and event.input_dtypes[copied] in DTYPES:
        shape = event.input_shapes[copied]
        return StandIn("aten::clone", "", [shape, []], [event.input_dtypes[copied], ""], [None, None], [shape, []])
    return packed_layer_stand_in(event)


def _traced(event, cache: dict, with_backward: bool = False) -> fx.GraphModule | None:
    """``event``'s op traced by make_fx on meta tensors (``cache``: by the recorded call, as an
    eager loop repeats the same calls): its recorded overload, or (the profiler leaves the name
    empty) the first of the op's overloads whose schema takes the recorded arguments; None
    where none does. An RNN layer (``_VF.lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu``) is one op,
    as in a captured graph (``keep_ops_whole``), not the per-step ops its meta kernel runs."""
    key = (event.name, event.overload_name, repr(event.input_shapes), repr(event.input_dtypes),
           repr(event.concrete_inputs), repr(getattr(event, "structured_input_shapes", None)), with_backward)
    if key not in cache:
        cache[key] = _trace(stand_in(event), with_backward)
    return cache[key]


def _trace(event, with_backward: bool) -> fx.GraphModule | None:
    namespace, _, name = event.name.partition("::")
    packet = getattr(getattr(torch.ops, namespace, None), name, None)
    if packet is None:
        return None
    names = [event.overload_name] if event.overload_name else sorted(packet.overloads(), key=lambda n: n != "default")
    for overload in names:
        op = getattr(packet, overload, None)
        if op is None or len(op._schema.arguments) != len(event.input_shapes):
            continue
        try:
            args, kwargs, tensors = _arguments(op, event)
            whole = WHOLE_LAYERS.get(event.name) if overload == "input" else WHOLE_CELLS.get(event.name)
            call = whole or op

            def run(*ts):
                outputs = call(*_filled(args, ts), **dict(zip(kwargs, _filled(kwargs.values(), ts))))
                if with_backward:  # the layer's gradients for its input and weights
                    leaves = [t for t in ts if t.requires_grad]
                    outs = [o for o in torch.utils._pytree.tree_leaves(outputs) if o.requires_grad]
                    return torch.autograd.grad(outs, leaves, [torch.ones_like(o) for o in outs], allow_unused=True)
                return outputs
            if with_backward:
                tensors = [t.requires_grad_() if t.is_floating_point() else t for t in tensors]
            # grad mode first: keep_ops_whole reads it to tell a training trace from an inference one;
            # nonzero keeps every element (no values on meta tensors: sizes after it are upper bounds)
            with torch.set_grad_enabled(with_backward), keep_ops_whole() if whole else contextlib.nullcontext(), \
                    meta_config.patch(meta_nonzero_assume_all_nonzero=True):
                return make_fx(run)(*tensors)
        except Exception:  # an argument this overload takes otherwise, or the profiler does not record
            continue
    return None


class _Tensor:
    """A tensor argument's place in the list make_fx traces over."""

    def __init__(self, position: int):
        self.position = position


def _arguments(op, event) -> tuple[list, dict, list]:
    """(positional arguments and keyword-only ones, with ``_Tensor`` places, and the meta tensors
    for them) rebuilt from the profiler's shapes, dtypes and values along ``op``'s schema. The
    tensors of a tensor list (``cat``'s, an RNN's weights) have recorded shapes but no dtype:
    they take the first single tensor's (float32 where there is none)."""
    list_dtype = next((DTYPES[d] for d in event.input_dtypes if d in DTYPES), torch.float32)
    lists = getattr(event, "structured_input_shapes", None) or [None] * len(event.input_shapes)
    args, kwargs, tensors = [], {}, []
    for argument, shape, dtype, value, listed in zip(op._schema.arguments, event.input_shapes, event.input_dtypes,
                                                     event.concrete_inputs, lists):
        if dtype == "TensorList" and str(argument.type) == "List[Tensor]" and isinstance(listed, list):
            rebuilt = [_tensor(s, list_dtype, tensors) for s in listed]
        else:
            rebuilt = _argument(argument.type, shape, dtype, value, tensors)
        if argument.kwarg_only:
            kwargs[argument.name] = rebuilt
        else:
            args.append(rebuilt)
    return args, kwargs, tensors


def _tensor(shape, dtype: torch.dtype, tensors: list) -> _Tensor:
    tensors.append(torch.empty(shape, dtype=dtype, device="meta"))
    return _Tensor(len(tensors) - 1)


def _argument(schema_type, shape, dtype: str, value, tensors: list):
    """One argument of ``schema_type``; a tensor is appended to ``tensors``."""
    optional = isinstance(schema_type, torch.OptionalType)
    kind = str(schema_type.getElementType() if optional else schema_type)
    if dtype in DTYPES and kind == "Tensor":
        return _tensor(shape, DTYPES[dtype], tensors)
    if "Tensor" in kind:
        if optional and value is None and dtype == "":
            return None
        raise ValueError(f"a {kind} argument recorded as {dtype!r} is not replayed")
    if dtype in DTYPES:
        raise ValueError(f"a tensor recorded where the schema takes {kind}")
    if "ScalarType" in kind:
        return SCALAR_TYPES[value] if value is not None else None
    if "Device" in kind:
        return torch.device("meta")
    if "Layout" in kind or "MemoryFormat" in kind:
        return None  # the defaults: strided, contiguous
    return value


def _filled(args, tensors) -> list:
    """``args`` with each ``_Tensor`` place (also inside a list) replaced by its tensor."""
    return [tensors[a.position] if isinstance(a, _Tensor) else
            [tensors[t.position] for t in a] if isinstance(a, list) and a and isinstance(a[0], _Tensor) else a
            for a in args]
