"""Small hand-built graphs the cuda_graphs tests share (partition, rewrite, runner)."""
import torch

aten = torch.ops.aten
ALWAYS = float("-inf")  # min_gain_us that keeps every region


def call(graph, target, *args, name=None):
    return graph.create_node("call_function", target, args, name=name)


def split_by_syncs(g, x):
    """relu, neg | item (host sync) | mul reads the host value | exp, getitem-free | nonzero | sigmoid"""
    a = call(g, aten.relu.default, x, name="relu")
    b = call(g, aten.neg.default, a, name="neg")
    s = call(g, aten._local_scalar_dense.default, call(g, aten.sum.default, b, name="total"), name="item")
    c = call(g, aten.mul.Tensor, b, s, name="mul")
    d = call(g, aten.exp.default, c, name="exp")
    e = call(g, aten.add.Tensor, d, b, name="add")
    nz = call(g, aten.nonzero.default, e, name="nonzero")
    f = call(g, aten.sigmoid.default, e, name="sigmoid")
    return f, nz


def names(regions):
    return [[n.name for n in r] for r in regions]


def chain(n_ops):
    def build(g, x):
        y = x
        for i in range(n_ops):
            y = call(g, aten.relu.default if i % 2 else aten.neg.default, y, name=f"op{i}")
        return y
    return build
