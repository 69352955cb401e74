"""Values a graph computes from no input are computed once at capture (capturing.constants)."""
from collections import Counter

import pytest
import torch

import fxdream
from fxdream.capturing.constants import MAX_CONSTANT_BYTES, fold_input_free_values
from fxdream.capturing.dynamo import compile_with
from conftest import assert_same_training_step

aten = torch.ops.aten


class RelativeIndex(torch.nn.Module):
    """Rebuilds a relative-position index with in-place slice writes on every call (as BEiT does)
    and gathers a learned bias with it."""

    def __init__(self, window=3):
        super().__init__()
        self.window = window
        self.table = torch.nn.Parameter(torch.randn((2 * window - 1) ** 2, 2))

    def index(self):
        coords = torch.stack(torch.meshgrid(torch.arange(self.window), torch.arange(self.window), indexing="ij"))
        flat = coords.flatten(1)
        relative = (flat[:, :, None] - flat[:, None, :]).permute(1, 2, 0).contiguous()
        relative[:, :, 0] += self.window - 1
        relative[:, :, 1] += self.window - 1
        relative[:, :, 0] *= 2 * self.window - 1
        return relative.sum(-1)

    def forward(self, x):
        bias = self.table[self.index().view(-1)].view(self.window ** 2, self.window ** 2, 2).permute(2, 0, 1)
        return x + bias


def _ops(gm):
    return Counter(n.target for n in gm.graph.nodes if n.op == "call_function")


@pytest.fixture
def through_dynamo(monkeypatch):
    """Capture through dynamo and aot_autograd, whose functional graph spells each in-place slice
    write as select/select_scatter (torch.fx's trace runs the index's code once, as a constant)."""
    monkeypatch.setattr(fxdream.build, "compile_model", lambda model, inputs, session, training: (
        compile_with(model, session), "dynamo (test)"))


def test_an_index_rebuilt_every_call_is_computed_once_and_equal_in_inference(through_dynamo):
    torch.manual_seed(0)
    model = RelativeIndex().eval()
    x = torch.randn(4, 2, 9, 9)
    optimized = fxdream.optimize(model, (x,), passes=())
    ops = _ops(optimized.captured[0].forward)
    assert ops[aten.select_scatter.default] == 0 and ops[aten.arange.default] == 0, ops
    assert ops[aten.index.Tensor] == 1  # the gather from the parameter still runs on every call
    (note,) = [note for note in optimized.report.notes if "computed once at capture" in note]
    assert "1 value(s) the forward computes from no input" in note
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), rtol=0, atol=0)
        model.table.add_(1.0)  # the parameter is read on every call, not folded with the index
        torch.testing.assert_close(optimized(x), model(x), rtol=0, atol=0)


def test_training_gradients_equal_with_the_index_folded(through_dynamo):
    torch.manual_seed(0)
    model = RelativeIndex()
    optimized = fxdream.optimize(model, (torch.randn(4, 2, 9, 9),), passes=(), training=True)
    assert _ops(optimized.captured[0].forward)[aten.select_scatter.default] == 0
    assert assert_same_training_step(model, optimized, (torch.randn(4, 2, 9, 9),)) == 1


def _graph(build):
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output(build(graph, x))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _call(graph, op, *args, **kwargs):
    return graph.call_function(op, args, kwargs)


def test_a_returned_constant_is_a_fresh_copy_on_every_call():
    gm = _graph(lambda g, x: (_call(g, aten.mul.Tensor, _call(g, aten.arange.default, 4), 2),
                              _call(g, aten.relu.default, x)))
    assert fold_input_free_values(gm) == ["mul_tensor"]
    first, _ = gm(torch.randn(2))
    second, _ = gm(torch.randn(2))
    assert first.data_ptr() != second.data_ptr()
    first.add_(100)  # the caller writes what it got; the next call is unaffected
    torch.testing.assert_close(gm(torch.randn(2))[0], torch.arange(4) * 2)
    assert _ops(gm) == Counter({aten.clone.default: 1, aten.relu.default: 1})


def test_what_is_not_folded():
    one_op = _graph(lambda g, x: _call(g, aten.add.Tensor, x, _call(g, aten.arange.default, 4)))
    random = _graph(lambda g, x: _call(g, aten.add.Tensor, x, _call(g, aten.mul.Tensor, _call(
        g, aten.rand.default, [4]), 2)))
    side = int((MAX_CONSTANT_BYTES // 4) ** 0.5) + 1
    large = _graph(lambda g, x: _call(g, aten.add.Tensor, x, _call(g, aten.mul.Tensor, _call(
        g, aten.ones.default, [side, side]), 2)))
    from_input = _graph(lambda g, x: _call(g, aten.mul.Tensor, _call(g, aten.relu.default, x), 2))
    for gm in (one_op, random, large, from_input):
        before = _ops(gm)
        assert fold_input_free_values(gm) == []
        assert _ops(gm) == before


class _ReturnsATable(torch.nn.Module):
    """Returns a tensor it builds from no input beside its output (a trace makes it a constant)."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.gelu(self.fc(x)), torch.arange(8).float() * 2 + 1


@pytest.mark.parametrize("passes", [[], ["reinplace"]])
def test_a_returned_constant_is_fresh_memory_the_caller_may_write(passes):
    """Eager builds the table on every call: a caller's in-place write to one call's output must
    not change the next call's, as it did where the trace returned its constant itself."""
    torch.manual_seed(0)
    model, x = _ReturnsATable().eval(), torch.randn(3, 8)
    optimized = fxdream.optimize(model, (x,), passes=passes)
    assert optimized.report.capture.startswith("torch.fx")
    _, first = optimized(x)
    first.add_(100.0)
    _, second = optimized(x)
    with torch.no_grad():
        torch.testing.assert_close(second, model(x)[1], rtol=0, atol=0)
