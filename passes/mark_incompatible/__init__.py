"""mark_incompatible: say, node by node, what cannot go into a CUDA graph and why.

As MXNet's ``FIsCUDAGraphsCompatible`` (apache/mxnet #19142), every op is compatible unless
a rule or the per-op registry says otherwise; users extend the registry with
``cuda_graph_incompatible(op, reason)``. The built-in rules, checked in this order:

- host synchronisation: ops tagged ``data_dependent_output`` (``.item()``,
  ``_local_scalar_dense``, ``equal``) read a device value on the host;
- data-dependent output shapes: ops tagged ``dynamic_output_shape`` (``nonzero``,
  ``masked_select``, ``unique``; ``index`` only with boolean masks, ``repeat_interleave``
  only without ``output_size``) size their output from tensor values;
- ops tagged ``cudagraph_unsafe`` (torch.Tag, when this torch has it);
- control flow: higher-order ops (``cond``, ``while_loop``) pick a branch from a value;
- random numbers in training: ops tagged ``nondeterministic_seeded`` (dropout with
  ``train=False`` or ``p=0`` draws nothing and stays compatible, as in eval);
- sparse tensors, symbolic (dynamic) sizes, non-tensor outputs;
- CPU tensors in a graph that runs on CUDA; a 0-d CPU tensor is not a reason
  (pytorch/pytorch #119241): a constant one is read at capture, a varying one (a graph
  input) is copied into a device scalar by the runner on every replay;
- mutation of a graph input, naming the input and where the mutation is (#117281);
- reading a host value (an int or float) that another node computes at run time.

Every marked node gets ``meta["fxdream.cuda_graph"] = reason``; the pass's notes list them
all, by layer, in graph order: no node is ever left out silently.

The pass changes no computation: it returns ``modified=False`` and the notes, so the
pipeline keeps the graph as it was (the marks are on the pass's copy). ``cuda_graphs``
marks the graph itself with the same function before it partitions.
"""
from __future__ import annotations

import operator
from collections import Counter

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fxdream.ir.aliasing import aliases_input
from fxdream.ir.nodes import ROOT_LAYER_LABEL, is_view, op_name, schema_arguments
from fxdream.pass_api import LAYER, PassBase, PassContext, PassResult, register_pass, value_of
from fxdream.passes.mark_incompatible.registry import (  # noqa: F401  (public here too)
    _COMPATIBLE,
    _registered,
    cuda_graph_compatible,
    cuda_graph_incompatible,
    forget_cuda_graph_op,
)

CUDA_GRAPH = "fxdream.cuda_graph"  # node.meta key: why the node cannot be in a CUDA graph

# --- the built-in rules ------------------------------------------------------------------------

def _tag(name: str):
    return getattr(torch.Tag, name, None)  # cudagraph_unsafe is newer than some torch versions


def _tags(node: fx.Node) -> tuple:
    return tuple(getattr(node.target, "tags", ()) or ())



def _is_symbolic(x) -> bool:
    return isinstance(x, (torch.SymInt, torch.SymFloat, torch.SymBool)) and not _concrete(x)


def _concrete(x) -> bool:
    try:
        return x.node.is_constant() or x.node.maybe_as_int() is not None
    except Exception:  # a symbol without a hint
        return False


def _shape_text(t: torch.Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _tensor_args(node: fx.Node):
    """(argument description, fx node or None, value) for each tensor argument."""
    found = []
    flat, _ = tree_flatten((node.args, node.kwargs))
    for position, arg in enumerate(flat):
        value = value_of(arg)
        if isinstance(value, torch.Tensor):
            label = f"'{arg.name}'" if isinstance(arg, fx.Node) else f"argument {position}"
            found.append((label, arg if isinstance(arg, fx.Node) else None, value))
    return found


def _host_sync(node, ctx, op, tags):
    if _tag("data_dependent_output") in tags or op in ("aten.item", "aten._local_scalar_dense", "aten.is_nonzero"):
        return f"host synchronisation: {op} copies a device value to the host (like .item())"
    return None


def _dynamic_shape_output(node, ctx, op, tags):
    if _tag("dynamic_output_shape") not in tags:
        return None
    if op == "aten.index":  # static unless an index is a boolean mask
        indices = node.args[1] if len(node.args) > 1 else node.kwargs.get("indices", ())
        masks = [value_of(i) for i in indices or () if isinstance(value_of(i), torch.Tensor)
                 and value_of(i).dtype in (torch.bool, torch.uint8)]
        if not masks:
            return None
    if op == "aten.repeat_interleave" and node.kwargs.get("output_size") is not None:
        return None
    return (f"data-dependent output shape: the size of {op}'s output depends on tensor values "
            f"(it synchronises with the host and allocates at run time)")


def _unsafe_tag(node, ctx, op, tags):
    unsafe = _tag("cudagraph_unsafe")
    if unsafe is not None and unsafe in tags:
        return f"{op} is tagged cudagraph_unsafe"
    return None


def _control_flow(node, ctx, op, tags):
    if isinstance(node.target, torch._ops.HigherOrderOperator):  # private class; no public alias
        return f"control flow: {op} decides what runs from a tensor value"
    return None


def _argument(node, name: str, default=None):
    """The value of ``node``'s argument called ``name`` in its op's schema, passed by position
    or by keyword (``default`` where it is not given, or the op has no such argument)."""
    schema = getattr(node.target, "_schema", None)
    names = [a.name for a in schema.arguments] if schema is not None else []
    if name not in names:
        return default
    position = names.index(name)
    return node.args[position] if position < len(node.args) else node.kwargs.get(name, default)


def _rng_in_training(node, ctx, op, tags):
    """An op that draws random numbers on every call; not dropout that draws nothing (``p`` or
    ``dropout_p`` 0, as in attention layers built with no dropout, or ``train=False``)."""
    if not ctx.training or _tag("nondeterministic_seeded") not in tags:
        return None
    if _argument(node, "train", True) is False or any(
            isinstance(p, (int, float)) and p == 0 for p in (_argument(node, "p"), _argument(node, "dropout_p"))):
        return None  # draws nothing: an identity, as in eval
    return f"random numbers in training: {op} draws new values on every call (dropout is compatible in eval)"


_OP_RULES = (_host_sync, _dynamic_shape_output, _unsafe_tag, _control_flow, _rng_in_training)


def _sparse(node, graph_device):
    for label, _, value in _tensor_args(node) + [("its output", None, v) for v in _output_tensors(node)]:
        if value.layout not in (torch.strided, torch._mkldnn):  # oneDNN's packed weights: dense, blocked
            return f"sparse tensor: {label} has layout {str(value.layout).replace('torch.', '')}"
    return None


def _output_tensors(node: fx.Node) -> list:
    leaves, _ = tree_flatten(node.meta.get("val"))
    return [t for t in leaves if isinstance(t, torch.Tensor)]


def _unbacked(x) -> bool:
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols
    try:
        return bool(free_unbacked_symbols(x))
    except Exception:
        return False


def _symbolic(node, graph_device):
    value = node.meta.get("val")
    for label, _, t in _tensor_args(node) + [("its output", None, v) for v in _output_tensors(node)]:
        for size in t.shape:
            if _is_symbolic(size) and _unbacked(size):
                return f"data-dependent size: {label} has size {size}, known only at run time"
            if _is_symbolic(size):
                return (f"dynamic shape: {label} has symbolic size {size}; a CUDA graph replays fixed sizes "
                        "(capture with dynamic=False)")
    flat, _ = tree_flatten((node.args, node.kwargs))
    for arg in flat:
        if _is_symbolic(arg):
            return f"dynamic shape: argument {arg} is symbolic; a CUDA graph replays fixed sizes"
    if _is_symbolic(value):
        return f"dynamic shape: {op_name(node)} returns symbolic {value}; a CUDA graph replays fixed sizes"
    return None


def _non_tensor_output(node, graph_device):
    if "val" not in node.meta:
        return None  # nothing known about the output: nothing to object to
    value = node.meta["val"]
    if value is None:
        schema = getattr(node.target, "_schema", None)
        if schema is None or not schema.returns:
            return None  # returns nothing (an assert, a record): no value to produce
    if isinstance(value, torch.Tensor):
        return None
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) or v is None or
                                                isinstance(v, (int, float, bool)) for v in value):
        return None  # tensors, and host numbers fixed by the static shapes (e.g. flash attention's)
    if node.target is operator.getitem and isinstance(value, (int, float, bool)):
        return None  # a number fixed at trace time, picked from a compatible op's result
    return f"non-tensor output: {op_name(node)} returns a Python {type(value).__name__}, a value on the host"


def _cpu_tensor(node, graph_device, constants: set):
    if graph_device != "cuda":
        return None
    for label, arg, value in _tensor_args(node):
        if value.device.type == "cpu" and value.dim() > 0:
            return (f"CPU tensor in a CUDA graph: {label} (shape {_shape_text(value)}) is on the CPU; "
                    "only 0-d CPU scalars are copied to the device")
    outputs = _output_tensors(node)
    if any(t.device.type == "cpu" for t in outputs):
        cpu = next(t for t in outputs if t.device.type == "cpu")
        inputs = [arg for _, arg, _ in _tensor_args(node)]
        if cpu.dim() == 0 and all(arg is not None and arg in constants for arg in inputs):
            constants.add(node)
            return None  # a constant scalar: computed once at capture, the same on every replay
        return (f"runs on the CPU: {op_name(node)} computes a CPU tensor (shape {_shape_text(cpu)}) "
                "that a CUDA graph would not recompute on replay")
    return None


def _input_origin(placeholder: fx.Node, ctx: PassContext, position: int) -> str:
    if placeholder.op == "get_attr":
        return f"constant attribute {placeholder.target}"
    kind = "the model's parameter or buffer" if placeholder.name in ctx.params else f"graph input #{position}"
    desc = placeholder.meta.get("desc")
    return kind + (f", {desc}" if desc is not None else "")


def _where(node: fx.Node) -> str:
    layer = node.meta.get(LAYER)
    text = f" in layer '{layer or ROOT_LAYER_LABEL}'" if layer is not None else ""
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.strip().splitlines() if ln.strip()]
    files = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if files:
        last = files[-1]
        text += f" ({lines[last]}" + (f": {lines[last + 1]}" if last + 1 < len(lines) else "") + ")"
    return text


def _mutated_input(node, ctx, roots: dict, positions: dict):
    for argument, value in schema_arguments(node):
        info = argument.alias_info
        if info is None or not info.is_write:
            continue
        for arg in (value if isinstance(value, (list, tuple)) else [value]):
            root = roots.get(arg) if isinstance(arg, fx.Node) else None
            if root is not None:
                return (f"mutates graph input '{root.name}' ({_input_origin(root, ctx, positions.get(root, -1))}) "
                        f"in place{_where(node)}; a CUDA graph writes to its own copy of the input")
    return None


def _host_value_input(node, marked: dict):
    """Reads an int/float another node computes at run time (a CUDA graph would bake it in)."""
    for arg in node.all_input_nodes:
        value = arg.meta.get("val")
        if arg.op == "call_function" and arg in marked and not isinstance(value, torch.Tensor) and \
                not (isinstance(value, (tuple, list))):
            return (f"reads a host value: '{arg.name}' ({op_name(arg)}) is computed at run time; a CUDA graph "
                    "would replay the value it had at capture")
    return None


def graph_device(gm: fx.GraphModule) -> str:
    """"cuda" if any value of the graph lives on a CUDA device, else the most common device type."""
    counts: Counter = Counter()
    for node in gm.graph.nodes:
        for t in _output_tensors(node):
            counts[t.device.type] += 1
    if counts["cuda"]:
        return "cuda"
    return counts.most_common(1)[0][0] if counts else "cpu"


def incompatibility(node: fx.Node, ctx: PassContext) -> str | None:
    """Why one node cannot be captured (op rules only, no graph context), or None."""
    op, tags = op_name(node), _tags(node)
    registered = _registered(node, ctx)
    if registered is _COMPATIBLE:
        return None
    if registered is not None:
        return registered
    for rule in _OP_RULES:
        reason = rule(node, ctx, op, tags)
        if reason is not None:
            return reason
    return None


def mark_incompatible(gm: fx.GraphModule, ctx: PassContext) -> dict[fx.Node, str]:
    """Set ``meta[CUDA_GRAPH]`` on every node that cannot be captured; return node → reason.

    Only call_function nodes can be captured: call_module / call_method nodes are marked too.
    """
    device = graph_device(gm)
    roots: dict[fx.Node, fx.Node] = {}   # value → the graph input it aliases
    positions: dict[fx.Node, int] = {}
    constants: set[fx.Node] = set()
    marked: dict[fx.Node, str] = {}
    for node in gm.graph.nodes:
        node.meta.pop(CUDA_GRAPH, None)
        if node.op == "placeholder":
            roots[node] = node
            positions[node] = len(positions)
            continue
        if node.op == "get_attr":
            constants.add(node)
            continue
        if node.op == "output":
            continue
        if node.op != "call_function":
            reason = f"not an ATen call ({node.op} {node.target}): fxdream cannot check it"
        else:
            reason = (incompatibility(node, ctx) or _sparse(node, device) or _symbolic(node, device)
                      or _non_tensor_output(node, device) or _cpu_tensor(node, device, constants)
                      or _mutated_input(node, ctx, roots, positions) or _host_value_input(node, marked))
        first = node.all_input_nodes[0] if node.all_input_nodes else None
        if first in roots and _is_alias(node):
            roots[node] = roots[first]
        if reason is not None:
            node.meta[CUDA_GRAPH] = reason
            marked[node] = reason
    return marked


def _is_alias(node: fx.Node) -> bool:
    if node.op != "call_function":
        return False
    return is_view(node) or aliases_input(node)


def marked_notes(marked: dict[fx.Node, str]) -> tuple[str, ...]:
    """One line per marked node, grouped by layer (layers in graph order)."""
    by_layer: dict[str, list[str]] = {}
    for node, reason in marked.items():
        layer = node.meta.get(LAYER, "") or ROOT_LAYER_LABEL
        by_layer.setdefault(layer, []).append(f"{layer}: {node.name}: {reason}")
    return tuple(line for lines in by_layer.values() for line in lines)


@register_pass
class MarkIncompatible(PassBase):
    """Marks what cannot be captured in a CUDA graph; changes no computation (modified=False)."""
    name = "mark_incompatible"

    def requires(self, ctx: PassContext) -> str | None:
        if not ctx.forced:  # "auto" chooses rewrites; this one only reports
            return "reports only, changes no graph (name the pass to get its report)"
        return None

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        marked = mark_incompatible(gm, ctx)
        if not marked:
            return PassResult(gm, False, "every node is compatible with CUDA graphs")
        kinds = Counter(reason.split(":", 1)[0] for reason in marked.values())
        summary = ", ".join(f"{n} {kind}" for kind, n in kinds.most_common())
        return PassResult(gm, False, f"{len(marked)} node(s) cannot be in a CUDA graph ({summary}); "
                                     "metadata only, the graph is unchanged", notes=marked_notes(marked))
