"""Values a graph computes from no input, computed once at capture.

A forward that rebuilds a table on every call from nothing it is given (Hugging Face BEiT's
relative position index: ``arange``, ``meshgrid``, in-place slice writes, ``sum``) runs that
work eagerly as a few fused ATen calls; aot_autograd's functional graph spells each in-place
write as ``select``/``select_scatter``/``copy`` and runs dozens of ops per call for a value that
never changes. Such values are computed once when the graph is captured and read from then on.

A node is input-free when no graph input (placeholder: user inputs, parameters, buffers, sizes)
reaches it and it is not random (an op tagged ``nondeterministic_seeded`` draws new values on
every call). Of the input-free nodes, those read by a node that is not input-free (the
frontier) are computed and become ``get_attr`` constants of the graph; the rest of their
subgraph is then dead and dropped. A frontier value is kept as it is made when:

- it took more than one op to make: a lone ``zeros``/``arange`` costs one op either way, and a
  shared tensor in its place would be one more thing a later in-place rewrite must not touch;
- it is at most ``MAX_CONSTANT_BYTES`` (eager allocates it per call and frees it; a constant
  stays resident);
- a graph output that returns it gets a copy (``aten.clone``), so every call still returns
  fresh memory the caller may write, as eager does.

Values are bit-identical: the same ops run once, on the same device, in the same order.
"""
from __future__ import annotations

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import unset_fake_temporarily

from fxdream.ir.nodes import LAYER, draws_random_numbers, is_view

MAX_CONSTANT_BYTES = 16 * 1024 * 1024
_CLONE = torch.ops.aten.clone.default
_PREFIX = "_fxdream_input_free_"
TRACE_CONSTANT = "_tensor_constant"  # what torch.fx and make_fx name a tensor a trace made into a constant


def fold_input_free_values(gm: fx.GraphModule) -> list[str]:
    """Replace each frontier value described above by a constant of ``gm`` (recompiled if any);
    the layers (or node names) whose values were folded."""
    input_free = _input_free_nodes(gm.graph)
    folded = []
    values = {}
    for node in gm.graph.nodes:
        if node not in input_free:
            continue
        values[node] = _evaluate(gm, node, values)
        readers = [user for user in node.users if user not in input_free]
        if readers and _worth_folding(node, input_free, values[node]):
            _replace_by_constant(gm, node, values[node], readers, len(folded))
            folded.append(node.meta.get(LAYER) or node.name)
    if folded:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return folded


def _input_free_nodes(graph: fx.Graph) -> set[fx.Node]:
    dependent: set[fx.Node] = set()
    free: set[fx.Node] = set()
    for node in graph.nodes:
        if node.op in ("placeholder", "output") or draws_random_numbers(node) or \
                any(arg in dependent for arg in node.all_input_nodes):
            dependent.add(node)
        elif node.op in ("call_function", "get_attr"):
            free.add(node)
        else:  # call_module / call_method: not in ATen graphs; left as they are
            dependent.add(node)
    return free


def _evaluate(gm: fx.GraphModule, node: fx.Node, values: dict):
    if node.op == "get_attr":
        value = gm
        for part in node.target.split("."):
            value = getattr(value, part)
        return value
    args = fx.node.map_arg(node.args, values.__getitem__)
    kwargs = fx.node.map_arg(node.kwargs, values.__getitem__)
    with torch.no_grad(), unset_fake_temporarily():  # aot_autograd compiles inside its fake mode
        return node.target(*args, **kwargs)


def _worth_folding(node: fx.Node, input_free: set[fx.Node], value) -> bool:
    if node.op != "call_function" or not isinstance(value, torch.Tensor):
        return False
    if value.untyped_storage().nbytes() > MAX_CONSTANT_BYTES:
        return False
    return _ops_to_make(node, input_free) > 1


def _ops_to_make(node: fx.Node, input_free: set[fx.Node]) -> int:
    """The call_function nodes ``node``'s value is made from (itself included)."""
    seen, stack = set(), [node]
    while stack:
        current = stack.pop()
        if current in seen or current not in input_free:
            continue
        seen.add(current)
        stack.extend(current.all_input_nodes)
    return sum(1 for n in seen if n.op == "call_function")


def _replace_by_constant(gm: fx.GraphModule, node: fx.Node, value: torch.Tensor, readers: list[fx.Node],
                         number: int) -> None:
    name = f"{_PREFIX}{number}"
    gm.register_buffer(name, value, persistent=False)  # made under no_grad
    with gm.graph.inserting_before(node):
        constant = gm.graph.get_attr(name)
    constant.meta.update({k: v for k, v in node.meta.items() if k in (LAYER, "val", "tensor_meta")})
    fresh = None
    for reader in readers:
        if reader.op == "output":  # returned: a copy per call, as eager returns new memory
            if fresh is None:
                with gm.graph.inserting_before(reader):
                    fresh = gm.graph.call_function(_CLONE, (constant,))
                fresh.meta.update(constant.meta)
            reader.replace_input_with(node, fresh)
        else:
            reader.replace_input_with(node, constant)


def copy_constant_outputs(gm: fx.GraphModule) -> int:
    """Give each output of an inference graph that is a constant of the graph (``get_attr``), or
    an ATen view of one, a copy per call (``aten.clone``), as eager returns fresh memory the
    caller may write. torch.fx's trace makes a tensor the forward builds from no input
    (``torch.arange(8) * 2``) a constant (``_tensor_constant0``); returned as it is, a caller's
    in-place write to the output would change every later call's. Returns how many outputs were
    copied."""
    output = gm.graph.output_node()
    copied = {}
    for node in output.all_input_nodes:
        source = node
        while source.op == "call_function" and is_view(source) and source.args \
                and isinstance(source.args[0], fx.Node):
            source = source.args[0]
        if source.op != "get_attr" or not source.target.rpartition(".")[2].startswith(TRACE_CONSTANT) \
                or node in copied:
            continue  # a parameter or buffer returned is the model's own tensor, in eager too
        with gm.graph.inserting_before(output):
            copied[node] = gm.graph.call_function(_CLONE, (node,))
        copied[node].meta.update({k: v for k, v in node.meta.items() if k in (LAYER, "val", "tensor_meta")})
    for node, fresh in copied.items():
        output.replace_input_with(node, fresh)
    if copied:
        gm.recompile()
    return len(copied)

