"""reinplace: an elementwise op writes its input in place only where no one can tell."""
import copy

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils.checkpoint import checkpoint

import fxdream
from fxdream import models
from fxdream.ir.nodes import op_name
from fxdream.passes.reinplace import in_place_twin, reinplace_graph
from fxdream.sim.graph_regions import CUDA_GRAPH_REGION

aten = torch.ops.aten


def _traced(f, *shapes):
    return make_fx(f, tracing_mode="fake")(*[torch.randn(s) for s in shapes])


def _ops(gm):
    return [op_name(n) for n in gm.graph.nodes if n.op == "call_function"]


def _rewritten(f, *shapes):
    """(ops after the rewrite, what it reported); the rewritten graph must compute what ``f`` does."""
    gm = _traced(f, *shapes)
    changed = reinplace_graph(gm)
    gm.recompile()
    inputs = [torch.randn(s) for s in shapes]
    torch.testing.assert_close(gm(*inputs), f(*inputs), atol=0, rtol=0)
    return _ops(gm), changed


def test_in_place_twins_are_found_for_pointwise_ops_only():
    assert in_place_twin(aten.relu.default) is aten.relu_.default
    assert in_place_twin(aten.add.Tensor) is aten.add_.Tensor
    assert in_place_twin(aten.clamp_min.default) is aten.clamp_min_.default
    for op in (aten.view.default, aten.mm.default, aten.sum.dim_IntList, aten.t.default, len):
        assert in_place_twin(op) is None


def test_a_dead_intermediate_is_overwritten():
    ops, changed = _rewritten(lambda x: torch.relu(x * 2), (3, 4))
    assert ops == ["aten.mul", "aten.relu_"] and len(changed) == 1


def test_graph_inputs_outputs_and_later_reads_are_never_overwritten():
    assert _rewritten(lambda x: torch.relu(x), (3, 4))[0] == ["aten.relu"]  # a graph input

    def output_too(x):
        y = x * 2
        return torch.relu(y), y
    assert _rewritten(output_too, (3, 4))[0] == ["aten.mul", "aten.relu"]

    def read_later(x):
        y = x * 2
        z = torch.relu(y)  # y is read after: relu stays; z is dead after the add: the add writes it
        return z + y
    assert _rewritten(read_later, (3, 4))[0] == ["aten.mul", "aten.relu", "aten.add_"]


def test_add_and_mul_overwrite_their_second_argument_sub_does_not():
    def add(x):
        a, b = x * 2, x * 3
        return a + b, a  # a is an output: b, which is dead, takes the result
    gm = _traced(add, (3, 4))
    reinplace_graph(gm)
    (written,) = [n for n in gm.graph.nodes if op_name(n) == "aten.add_"]
    assert written.args[0].name == "mul_1"  # b

    def sub(x):
        a, b = x * 2, x * 3
        return a - b, a
    assert _rewritten(sub, (3, 4))[0] == ["aten.mul", "aten.mul", "aten.sub"]


def test_no_broadcast_or_type_promotion_into_the_overwritten_tensor():
    def broadcast(x, bias):
        return bias * 2 + x  # bias * 2 is [4], the sum [3, 4]
    assert _rewritten(broadcast, (3, 4), (4,))[0] == ["aten.mul", "aten.add"]

    def promote(x):
        return (x > 0).int() + 0.5  # int32 in, float32 out
    assert "aten.add" in _rewritten(promote, (3, 4))[0]


def _read_before(x):
    y = x * 2
    s = y.sum()
    return torch.relu(y), s


def test_a_view_read_later_rules_it_out_a_view_or_a_write_before_does_not():
    def viewed_later(x):
        y = x * 2
        v = y.view(-1)
        return torch.relu(y), v.sum()  # the view reads y's memory after relu would write it
    assert "aten.relu" in _rewritten(viewed_later, (3, 4))[0]

    def viewed_before(x):  # the view's only reader runs before: nobody can tell
        y = x * 2
        s = y.view(-1).sum()
        return torch.relu(y), s
    assert "aten.relu_" in _rewritten(viewed_before, (3, 4))[0]

    def written_before(x):  # add_ wrote y before; no one reads it after relu
        y = x * 2
        y.add_(1)
        return torch.relu(y)
    assert _rewritten(written_before, (3, 4))[0] == ["aten.mul", "aten.add_", "aten.relu_"]

    # the same without the view: the sum reads y before relu writes it
    assert "aten.relu_" in _rewritten(_read_before, (3, 4))[0]


def test_a_chain_of_in_place_ops_shares_one_buffer():
    ops, changed = _rewritten(lambda x: torch.relu(x * 2 + x * 3), (3, 4))
    assert ops == ["aten.mul", "aten.mul", "aten.add_", "aten.relu_"] and len(changed) == 2


def test_an_unsafe_view_shares_its_input_memory():
    """aot writes ``_unsafe_view`` after a matmul; its schema claims a new tensor but it is a view
    (a fuzzed residual MLP's saved activation was overwritten through one)."""
    def saved(x):
        y = torch.relu(x * 2)
        u = torch.ops.aten._unsafe_view(y, [12])
        return u + 1, y  # y leaves the graph: the add must not write u
    ops, changed = _rewritten(saved, (3, 4))
    assert "aten.add" in ops and not any("add" in c for c in changed)

    def dead(x):
        u = torch.ops.aten._unsafe_view(x * 2, [12])
        return u + 1  # x * 2 dies here: writing it through u is fine
    assert "aten.add_" in _rewritten(dead, (3, 4))[0]


@pytest.mark.parametrize("mark", ["stream", "cuda_graph"])
def test_a_reader_on_another_stream_or_in_a_cuda_graph_region_rules_it_out(mark):
    gm = _traced(_read_before, (3, 4))
    reader = next(n for n in gm.graph.nodes if op_name(n) == "aten.sum")
    if mark == "stream":
        reader.meta["stream"] = 1  # an aux stream may still be reading y when relu would write it
    else:
        reader.meta[CUDA_GRAPH_REGION] = 0
    assert reinplace_graph(gm) == []


@pytest.mark.parametrize("name", models.NAMES)
def test_zoo_training_is_bit_identical_with_the_pass_forced(name):
    """Same kernels writing into other buffers: outputs and gradients equal to the last bit."""
    model, inputs, loss_fn = models.build(name, 2, tiny=True)
    loss = loss_fn or (lambda out: sum(t.float().sum() for t in torch.utils._pytree.tree_leaves(out)))
    results = []
    for passes in ([], ["reinplace"]):
        copied = copy.deepcopy(model)
        optimized = fxdream.optimize(copied, inputs, passes=passes, training=True, cost=None)
        torch.manual_seed(0)
        out = optimized(*inputs)
        loss(out).backward()
        results.append((out, [p.grad for p in copied.parameters()], optimized.report.passes))
    (out, grads, _), (out_r, grads_r, rows) = results
    assert any(row.applied for row in rows), [row.reason for row in rows]
    for a, b in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(out_r)):
        assert torch.equal(a, b)
    assert all((g is None and h is None) or torch.equal(g, h) for g, h in zip(grads, grads_r))


def test_after_aux_stream_backward_nothing_an_aux_stream_reads_is_overwritten():
    from fxdream.runtime import streams
    model, inputs, loss_fn = models.build("resnet18", 2, tiny=True)
    optimized = fxdream.optimize(model, inputs, passes=["aux_stream_backward", "reinplace"], training=True,
                                 cost=None)
    rows = {(r.name, r.phase): r for r in optimized.report.passes}
    assert rows[("aux_stream_backward", "bw")].applied and rows[("reinplace", "bw")].applied
    backward = optimized.rewritten_graphs[(0, "bw")]
    assert streams.stream_summary(backward).get(1, 0) > 0
    assert streams.check_stream_order(backward) == []
    written = [n for n in backward.graph.nodes if op_name(n).endswith("_") and op_name(n).startswith("aten.")]
    assert written and all(streams.node_stream(u) == 0 for n in written for u in n.args[0].users)


class ReluPlusOne(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) + 1)


def test_a_rewritten_training_module_under_checkpoint_gives_eagers_gradients():
    # checkpoint's recomputation stops the replayed forward by raising through it once it has what
    # it needs: that is not a failure of the rewritten graphs, to be answered by running eagerly
    torch.manual_seed(0)
    model, x = ReluPlusOne(), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    optimized = fxdream.optimize(model, (x,), passes=["reinplace"], training=True, eager_check=False)
    assert any(p.applied for p in optimized.report.passes if p.name == "reinplace")
    checkpoint(reference, x, use_reentrant=False).sum().backward()
    checkpoint(optimized, x, use_reentrant=False).sum().backward()
    for p, q in zip(reference.parameters(), model.parameters()):
        torch.testing.assert_close(q.grad, p.grad)
    assert not optimized.report.ran_eagerly
