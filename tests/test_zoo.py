"""Every tiny zoo model: captured in inference and training, layers on heavy ops, equal to eager."""
import pytest
import torch

import fxdream
from fxdream import models
from fxdream.ir.nodes import LAYER, op_name
from fxdream.ir.flops import node_flops
from conftest import assert_same_training_step

HEAVY_OPS = ("aten.convolution", "aten.convolution_backward", "aten.addmm", "aten.mm", "aten.bmm")


def _as_tuple(captured):
    return captured if isinstance(captured, tuple) else (captured,)


@pytest.mark.parametrize("name", models.NAMES)
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_zoo_capture_puts_a_layer_on_every_heavy_node(name, training):
    model, inputs, _ = models.build(name, 2, tiny=True)
    parts = _as_tuple(fxdream.capture(model, inputs, training=training))
    heavy = 0
    for part in parts:
        assert (part.backward is not None) == training
        for _, gm in part.graphs():
            for node in gm.graph.nodes:
                if op_name(node) in HEAVY_OPS:
                    heavy += 1
                    assert node.meta[LAYER], f"{name}: {node.format_node()} has no layer"
    assert heavy > 0


@pytest.mark.parametrize("name", models.NAMES)
def test_zoo_inference_equals_eager(name):
    model, inputs, _ = models.build(name, 2, tiny=True)
    model.eval()
    optimized = fxdream.optimize(model, inputs)
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs), model(*inputs), atol=1e-5, rtol=1e-4)
    assert optimized.report.fallback_reason is None


@pytest.mark.parametrize("name", models.NAMES)
def test_zoo_training_outputs_and_gradients_equal_eager(name):
    model, inputs, loss_fn = models.build(name, 2, tiny=True)
    optimized = fxdream.optimize(model, inputs, training=True)
    assert assert_same_training_step(model, optimized, inputs, loss_fn) > 0


def test_layers_after_a_graph_break_keep_their_full_names():
    # nn.LSTM breaks the graph; dynamo then compiles submodules' forwards as frames of their
    # own, whose module paths are relative: they must still be named from the model's root
    model, inputs, _ = models.build("gnmt", 2, tiny=True)
    parts = _as_tuple(fxdream.capture(model, inputs, training=True))
    assert len(parts) > 1
    layers = {n.meta[LAYER] for p in parts for _, gm in p.graphs() for n in gm.graph.nodes if LAYER in n.meta}
    assert "decoder.att_rnn.attn.linear_q" in layers
    assert "linear_q" not in layers


def test_rnn_modules_are_traced_in_inference_with_their_flops():
    # inference: dynamo traces nn.LSTM (allow_rnn while fxdream builds): one graph, exact, counted
    model, inputs, _ = models.build("gnmt", 2, tiny=True)
    model.eval()
    optimized = fxdream.optimize(model, inputs)
    assert len(optimized.report.graphs) == 1 and optimized.report.graph_breaks == ()
    with torch.no_grad():
        assert torch.equal(optimized(*inputs), model(*inputs))
    (captured,) = _as_tuple(optimized.captured)
    rnn = [n for n in captured.forward.graph.nodes if "rnn" in op_name(n) or "lstm" in op_name(n)]
    assert rnn and all(node_flops(n) > 0 for n in rnn)
