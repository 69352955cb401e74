"""fxdream's own probing prints nothing: a graph that fails when timed in context gives None
(its caller says what failed), not torch.fx's traceback on stderr; synthetic tangents have the
strides the graph was traced with."""
import logging

import pytest
import torch
import torch.fx as fx

import fxdream
from fxdream.runtime.direct_calls import call_ops_directly
from fxdream.sim.profile.in_context import ones_like, time_graph


def test_a_graph_that_raises_when_timed_prints_nothing(capsys):
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(graph.call_function(torch.ops.aten.view.default, (x, [16])))
    gm = call_ops_directly(fx.GraphModule(torch.nn.Module(), graph))  # as captured graphs call ops
    not_viewable = torch.randn(4, 4).t()
    assert time_graph(gm, [not_viewable], torch.device("cpu"), {}, rounds=2, warmup=0) is None
    assert capsys.readouterr().err == ""


def test_synthetic_tangents_keep_the_traced_strides():
    traced = torch.empty(2, 3, 4, 5).to(memory_format=torch.channels_last)
    made = ones_like(traced, torch.device("cpu"))
    assert made.stride() == traced.stride() and made.shape == traced.shape and bool((made == 1).all())
    assert ones_like(3, torch.device("cpu")) == 3


def test_a_wrong_input_shape_in_a_prediction_raises_torchs_error_without_fake_tensors_log():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
    logger, records = logging.getLogger("torch._subclasses.fake_tensor"), []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append
    logger.addHandler(handler)
    try:
        with pytest.raises(RuntimeError, match=r"shapes cannot be multiplied \(2x5"):
            fxdream.simulate(model, (torch.randn(2, 5),), device="h100")
    finally:
        logger.removeHandler(handler)
    assert not [r for r in records if "failed while attempting to run meta" in str(r.msg)]
    assert logger.filters == []  # the filter is the capture's only


def test_a_torch_fx_trace_that_fails_its_check_run_prints_nothing(capsys):
    class Attention(torch.nn.Module):  # traced, ``w`` is a proxy: the trace calls .sum on eager's None
        def __init__(self):
            super().__init__()
            self.attention = torch.nn.MultiheadAttention(16, 2, batch_first=True)

        def forward(self, q):
            out, w = self.attention(q, q, q, need_weights=False)
            return out if w is None else out + w.sum(-1, keepdim=True)

    model, q = Attention().eval(), torch.randn(2, 5, 16)
    built = fxdream.optimize(model, (q,))  # the torch.fx path declined: dynamo's capture
    with torch.no_grad():
        torch.testing.assert_close(built(q), model(q))
    assert "FX-traced Module" not in capsys.readouterr().err
