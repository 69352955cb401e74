"""Copies nothing needs are dropped from inference captures (fxdream.dead_copies)."""
import operator

import pytest
import torch

import fxdream
from fxdream import models
from fxdream.capturing.dead_copies import drop_dead_copies
from fxdream.capturing.dynamo import compile_with
from conftest import graph_with_values

aten = torch.ops.aten


def _clones(gm):
    return [n for n in gm.graph.nodes if n.target is aten.clone.default]


def _call(g, op, *args, **kwargs):
    return g.call_function(op, args, kwargs)


CASES = {
    # name: (build, shapes, dropped?)
    "fresh": (lambda g, x: _call(g, aten.clone.default, _call(g, aten.relu.default, x)), [(2, 3)], True),
    "graph input": (lambda g, x: _call(g, aten.clone.default, x), [(2, 3)], False),
    "read elsewhere": (lambda g, x: (lambda r: _call(g, aten.add.Tensor, _call(g, aten.clone.default, r), r))(
        _call(g, aten.relu.default, x)), [(2, 3)], False),
    "view of a fresh value": (lambda g, x: _call(g, aten.clone.default, _call(
        g, aten.view.default, _call(g, aten.relu.default, x), [6])), [(2, 3)], True),
    "view of a graph input": (lambda g, x: _call(g, aten.clone.default, _call(g, aten.view.default, x, [6])),
                              [(2, 3)], False),
    "new layout": (lambda g, x: _call(g, aten.clone.default, _call(g, aten.relu.default, x),
                                      memory_format=torch.channels_last), [(1, 3, 2, 2)], False),
    "same layout asked": (lambda g, x: _call(g, aten.clone.default, _call(g, aten.relu.default, x),
                                             memory_format=torch.contiguous_format), [(1, 3, 2, 2)], True),
    "item of a multi-output op": (lambda g, x, w, b: _call(g, aten.clone.default, _call(
        g, operator.getitem, _call(g, aten.native_layer_norm.default, x, [3], w, b, 1e-5), 0)),
        [(2, 3), (3,), (3,)], True),
}


@pytest.mark.parametrize("name", CASES)
def test_a_clone_goes_only_where_nothing_else_sees_its_input(name):
    build, shapes, dropped = CASES[name]
    gm = graph_with_values(build, *shapes)
    inputs = [torch.randn(s) for s in shapes]
    expected = gm(*inputs)
    assert bool(drop_dead_copies(gm)) is dropped and bool(_clones(gm)) is not dropped
    torch.testing.assert_close(gm(*inputs), expected, rtol=0, atol=0)


def test_bert_inference_through_dynamo_drops_its_dropout_copies_and_stays_bit_identical(monkeypatch):
    monkeypatch.setattr(fxdream.build, "compile_model", _through_dynamo)  # aot_autograd makes the copies
    model, inputs, _ = models.build("bert_base", 1, tiny=True)
    model.eval()
    with torch.no_grad():
        optimized = fxdream.optimize(model, inputs, passes=[], cost=None)
        torch.testing.assert_close(optimized(*inputs), model(*inputs), rtol=0, atol=0)
    assert optimized.report.capture.startswith("dynamo")
    (note,) = [n for n in optimized.report.notes if "copies of intermediates" in n]
    assert "dropped 8 copies" in note  # 2 layers x (attention probabilities, 2 hidden) + embeddings + pooler
    forward = optimized.captured[0].forward
    assert all(c.kwargs.get("memory_format") == torch.contiguous_format for c in _clones(forward))


def test_bert_inference_traced_once_has_no_dropout_copies_to_drop():
    model, inputs, _ = models.build("bert_base", 1, tiny=True)
    model.eval()
    with torch.no_grad():
        optimized = fxdream.optimize(model, inputs, passes=[], cost=None)
        torch.testing.assert_close(optimized(*inputs), model(*inputs), rtol=0, atol=0)
    assert optimized.report.capture == "torch.fx symbolic_trace"
    clones = _clones(optimized.captured[0].forward)
    assert len(clones) == 2 and all(c.args[0].target is aten.permute.default for c in clones)  # reshape's
    assert not [n for n in optimized.report.notes if "copies of intermediates" in n]


def _through_dynamo(model, inputs, session, training):
    return compile_with(model, session), "dynamo (test)"


def test_a_training_capture_keeps_them():
    model, inputs, loss_fn = models.build("bert_base", 1, tiny=True)
    model.eval()  # eval dropout, but a training capture: left as aot_autograd made it
    optimized = fxdream.optimize(model, inputs, passes=[], cost=None, training=True)
    assert not [n for n in optimized.report.notes if "copies of intermediates" in n]
