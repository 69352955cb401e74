"""What identifies one op for costing: its profile key, and the small helpers keys rest on.

Apart from ``cost`` so that the in-context timing (``in_context``) and the cost models can
both use them without importing each other."""
from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from ..annotate import VIEW_OPS, op_name, schema_arguments

# Ops that make the host wait for the device (a value read back, a data-dependent shape).
HOST_SYNC_OPS = frozenset({"aten._local_scalar_dense", "aten.item", "aten.nonzero", "aten.equal",
                           "aten.is_nonzero", "aten.masked_select", "aten.unique"})


@contextlib.contextmanager
def real_tensors():
    """Measurements need real tensors and plain dispatch, also inside aot_autograd's compiler
    callbacks: its fake mode is on there, and where it has a shape env (dynamo's captures, and
    some torch.fx ones) so is the Python dispatcher, which sends every op through Python. Under
    it, an inference GRU (a composite of ~2000 ATen calls) timed in context took 35-70 ms where
    it runs in ~7 ms, and the graph was predicted 5x slow."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily  # private; isolated here
    with unset_fake_temporarily(), torch._C._DisablePythonDispatcher():
        yield


def is_view(node: fx.Node) -> bool:
    return node.target is operator.getitem or op_name(node) in VIEW_OPS


def size_hint(x):
    """A concrete int for a symbolic size (dynamo's dynamic shapes: the size it was traced at),
    so costs and memory of a symbolic graph are those of its example; other values as they are."""
    if isinstance(x, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import optimization_hint  # no guard added
        return optimization_hint(x, fallback=1)
    return x


def arg_values(node: fx.Node):
    """(args, kwargs) of ``node`` with every node replaced by its example value."""
    return tree_map(lambda a: a.meta.get("val") if isinstance(a, fx.Node) else a, (node.args, node.kwargs))


def profile_key(node: fx.Node, device: str) -> str:
    """op + tensor shapes/dtypes/strides + other arguments + device: one measurement each.
    (The string ``tree_flatten`` of ``arg_values`` gives, built without pytree: a build makes
    thousands, 41 µs each that way on ResNet-50's graph.)"""
    parts: list[str] = []
    _describe_into(node.args, parts)
    if node.kwargs:
        kwargs = arg_values(node)[1]
        parts += [f"{k}={_describe(v)}" for k, v in sorted(kwargs.items())]
    return f"{op_name(node)}|{device}|{','.join(parts)}"


def _describe_into(a, parts: list) -> None:
    """Append a description of each leaf of ``a`` (pytree's leaves: lists, tuples and dicts
    flattened, a node stands for its value)."""
    if isinstance(a, fx.Node):
        a = a.meta.get("val")
    if isinstance(a, (list, tuple)):
        for item in a:
            _describe_into(item, parts)
    elif isinstance(a, dict):
        for leaf in tree_flatten(a)[0]:
            _describe_into(leaf, parts)
    else:
        parts.append(_describe(a))


def _describe(a) -> str:
    if isinstance(a, torch.Tensor):
        return f"T{_ints(a.shape)}:{str(a.dtype).replace('torch.', '')}:{_ints(a.stride())}"
    return repr(size_hint(a))


def _ints(values) -> tuple:
    values = tuple(values)
    return values if all(type(v) is int for v in values) else tuple(map(size_hint, values))


def same_layout(a, b) -> bool:
    """Two tensors (fake or real) of one dtype, shape and strides."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and tuple(a.shape) == tuple(b.shape) and tuple(a.stride()) == tuple(b.stride()))


UNKNOWN = object()  # a value made by something other than an ATen op: who knows what it aliases


def aliased_input(node: fx.Node):
    """The node whose memory ``node``'s value shares (a view's or an in-place op's input), None
    for new memory, UNKNOWN for a value not made by an ATen op (a graph input is its own base)."""
    if node.op == "placeholder":
        return None
    if node.op != "call_function":
        return UNKNOWN
    if node.target is operator.getitem:  # an item of a split aliases what the split aliases
        parent = node.args[0]
        return parent if isinstance(parent, fx.Node) and aliased_input(parent) is not None else None
    if not isinstance(node.target, torch._ops.OpOverload):
        return UNKNOWN
    if is_view(node):  # the project's view list, with aot's _unsafe_view (its schema claims new memory)
        return node.args[0]
    returns = node.target._schema.returns
    sets = {name for r in returns if r.alias_info is not None for name in r.alias_info.before_set}
    if not sets:
        return None
    for argument, given in schema_arguments(node):
        if argument.alias_info is not None and sets & set(argument.alias_info.before_set):
            return given if isinstance(given, fx.Node) else UNKNOWN
    return UNKNOWN


def written_inputs(gm: fx.GraphModule) -> frozenset[int] | None:
    """Positions of the placeholders whose memory ``gm`` writes (an in-place op or an ``out=``
    on one, or on a view of one), or None where that cannot be told (a call of something that
    is not an ATen op: a submodule, a Python function, an unknown alias)."""
    placeholders = {n: i for i, n in enumerate(n for n in gm.graph.nodes if n.op == "placeholder")}
    written = set()
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output", "get_attr"):
            continue
        if node.op != "call_function" or not (node.target is operator.getitem
                                               or isinstance(node.target, torch._ops.OpOverload)):
            return None
        for argument, given in schema_arguments(node):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            for value in tree_flatten(given)[0]:
                while isinstance(value, fx.Node) and value not in placeholders:
                    base = aliased_input(value)
                    if base is UNKNOWN:
                        return None
                    value = base
                if value in placeholders:
                    written.add(placeholders[value])
    return frozenset(written)
