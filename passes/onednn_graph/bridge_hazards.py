"""Graphs TorchScript's oneDNN Graph bridge would crash on (a segfault, which no ``except`` catches).

PyTorch's ``LlgaKernel`` lists a partition's inputs once per use (a tensor two of its ops read
is listed twice, and the constants come after the graph's inputs), and where oneDNN Graph
computes an output in place of an input (the ``sum`` post-op: the tensor a convolution's or a
linear's result is added to) it takes that input's position in this list as its index among the
distinct inputs: past a repeated input the index points beyond them, and the process dies on the
partition's first run. So a graph is declined where a partition may both read one tensor twice
and add into another. Partitions are oneDNN Graph's choice, not known before that run; the
partition of a convolution, linear or matrix product is taken as it and the chain of ops after it
that each read the one before as its only reader (the post-ops oneDNN fuses), so the check may
decline a graph that would have run (``(linear(a) + linear(b)) * b``), never pass one it knows
crashes (``(linear(a) + linear(b)) * b + a``). An add into the tensor read twice is safe: its
position is its index (``x + linear(x)``). A tensor counts as read twice where two of the graph's
nodes compute the same thing (``a * 2`` written three times: TorchScript merges them into one
value), and a matrix product's second operand is a read like its first (``mm(h, a) ... * a``).
"""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
import torch.nn.functional as F

aten = torch.ops.aten
PARTITION_ROOTS = frozenset({F.linear, F.conv1d, F.conv2d, F.conv3d, aten.mm.default, aten.addmm.default,
                             aten.bmm.default, aten.matmul.default, aten.convolution.default})
ADDS = frozenset({aten.add.Tensor, aten.add_.Tensor, operator.add, torch.add})


def _post_op_chain(root: fx.Node) -> list[fx.Node]:
    """The ops after ``root`` that each are the only reader of the one before (not another root)."""
    chain, node = [], root
    while len(node.users) == 1:
        user = next(iter(node.users))
        if user.op != "call_function" or user.target in PARTITION_ROOTS:
            break
        chain.append(user)
        node = user
    return chain


def _same_values(graph: fx.Graph) -> dict[fx.Node, fx.Node]:
    """Each node → the first node computing the same thing (same op on the same values): one value
    once TorchScript has merged the common subexpressions."""
    first, same = {}, {}
    for node in graph.nodes:
        same[node] = node
        if node.op != "call_function":
            continue
        try:
            key = (node.target, fx.node.map_arg(node.args, same.__getitem__),
                   tuple(sorted(fx.node.map_arg(node.kwargs, same.__getitem__).items())))
            same[node] = first.setdefault(_hashable(key), node)
        except TypeError:  # an argument that cannot be compared: its own value
            pass
    return same


def _hashable(value):
    if isinstance(value, (list, tuple)):
        return tuple(_hashable(v) for v in value)
    hash(value)  # raises TypeError where it cannot be a key
    return value


def crashing_partition(graph: fx.Graph) -> fx.Node | None:
    """The first root (convolution, linear, matrix product) whose partition may crash the bridge:
    a tensor read twice in it (an operand of the root that is not a constant, or of its post-ops)
    and an add in it whose other operand is another tensor; None where there is none."""
    same = _same_values(graph)
    for root in graph.nodes:
        if root.op != "call_function" or root.target not in PARTITION_ROOTS or not root.args:
            continue
        reads = [same[a] for a in root.args if isinstance(a, fx.Node) and a.op != "get_attr"]
        added = []
        previous = root
        for op in _post_op_chain(root):
            operands = [same[a] for a in op.args if isinstance(a, fx.Node) and a is not previous]
            reads += operands
            if op.target in ADDS:
                added += operands
            previous = op
        twice = {value for value in reads if reads.count(value) > 1}
        if twice and any(value not in twice for value in added):
            return root
    return None
