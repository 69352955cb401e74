"""Inference graphs traced once (fxdream.inference_trace) are aot_autograd's graphs, or None."""
import sys
from collections import Counter

import pytest
import torch
import torch.nn as nn
from torch._functorch.aot_autograd import aot_module_simplified

import fxdream
from fxdream.capturing.dead_copies import drop_dead_copies
from fxdream.capturing.inference_trace import inference_graph

aten = torch.ops.aten


class ConvBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.drop = nn.Dropout(0.2)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu_(self.bn(self.conv(x)))  # an in-place op on an intermediate: functionalized
        return self.fc(self.drop(y.mean((2, 3)))), y.flatten(1)


class BumpsItsInput(nn.Module):
    def forward(self, x):
        x.add_(1)
        return x * 2


class ItemScale(nn.Module):
    def forward(self, x):
        return x / (1.0 + x.abs().max().item())


def _traced(model):
    return torch.fx.symbolic_trace(model)


def _state(gm):
    return [*dict(gm.named_parameters(remove_duplicate=False)).values(),
            *dict(gm.named_buffers(remove_duplicate=False)).values()]


def _ops(gm):
    return Counter(str(n.target) for n in gm.graph.nodes if n.op == "call_function")


def test_the_graph_is_aot_autograds_and_runs_as_eager():
    model, x = ConvBlock().eval(), torch.randn(2, 3, 6, 6)
    gm = _traced(model)
    with torch.no_grad():
        ours = inference_graph(gm, [x])
        graphs = []
        aot_module_simplified(gm, [x], fw_compiler=lambda g, _: graphs.append(g) or g.forward)
        assert drop_dead_copies(graphs[0])  # aot_autograd's copy of the eval-mode dropout's input
        assert _ops(ours) == _ops(graphs[0])
        assert "aten._native_batch_norm_legit_no_training.default" in _ops(ours)
        assert "aten.relu_.default" not in _ops(ours) and "aten.empty.memory_format" not in _ops(ours)
        placeholders = [n.name for n in ours.graph.nodes if n.op == "placeholder"]
        assert placeholders == [n.name for n in graphs[0].graph.nodes if n.op == "placeholder"]
        for got, want in zip(ours(*_state(gm), x), model(x)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    conv = next(n for n in ours.graph.nodes if n.target is aten.convolution.default)
    assert list(conv.meta["nn_module_stack"].values())[-1][0] == "conv"  # ties the node to its layer


def test_tied_weights_stay_one_placeholder_each():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)).eval()
    model[1].weight = model[0].weight
    gm, x = _traced(model), torch.randn(3, 4)
    with torch.no_grad():
        graph = inference_graph(gm, [x])
        torch.testing.assert_close(graph(*_state(gm), x)[0], model(x), rtol=0, atol=0)
    assert len([n for n in graph.graph.nodes if n.op == "placeholder"]) == len(_state(gm)) + 1


@pytest.mark.parametrize("model, why", [(BumpsItsInput(), "mutates an input"), (ItemScale(), "data dependent")])
def test_graphs_aot_autograd_must_trace_are_refused(model, why):
    gm, x = _traced(model), torch.randn(3, 4)
    with torch.no_grad():
        assert inference_graph(gm, [x]) is None, why


def test_grad_mode_and_tensor_subclasses_are_refused():
    gm, x = _traced(ConvBlock().eval()), torch.randn(2, 3, 6, 6)
    assert inference_graph(gm, [x]) is None  # grad enabled: not an inference graph
    with torch.no_grad():
        assert inference_graph(gm, [x.as_subclass(SubTensor)]) is None


class SubTensor(torch.Tensor):
    pass


@pytest.mark.parametrize("model", [ConvBlock(), BumpsItsInput(), ItemScale()], ids=type)
def test_optimize_equals_eager_whichever_trace_it_took(model):
    model.eval()
    x = torch.randn(2, 3, 6, 6) if isinstance(model, ConvBlock) else torch.randn(3, 4)
    optimized = fxdream.optimize(model, (x.clone(),), passes="auto", cost="analytic")
    with torch.no_grad():
        eager_input, built_input = x.clone(), x.clone()
        want, got = model(eager_input), optimized(built_input)
    for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(want)):
        torch.testing.assert_close(a, b)
    torch.testing.assert_close(built_input, eager_input)  # an input updated in place: updated once


def test_a_trace_that_raises_leaves_the_graph_to_aot_autograd(monkeypatch):
    def broken(*args):
        raise RuntimeError("no fake kernel")
    monkeypatch.setattr(sys.modules["fxdream.capturing.session"], "inference_graph", broken)
    model, x = ConvBlock().eval(), torch.randn(2, 3, 6, 6)
    optimized = fxdream.optimize(model, (x,), cost=None)
    assert optimized.report.capture == "torch.fx symbolic_trace"
    assert any("dropped 1 copies" in note for note in optimized.report.notes)  # aot's, of the dropout's input
    with torch.no_grad():
        for got, want in zip(optimized(x), model(x)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
