"""SDPA stays one op in inference captures on a GPU (fxdream.sdpa_op)."""
import functools

import pytest
import torch
import torch.nn.functional as F

import fxdream
from fxdream.ops import keep_whole as rnn_op
from fxdream.ops.sdpa import attention_inference, redirect_attention


class Attention(torch.nn.Module):
    def __init__(self, dim=16, heads=2):
        super().__init__()
        self.qkv, self.out, self.heads = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim), heads

    def forward(self, x, mask):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.out(y.transpose(1, 2).reshape(b, s, d))


def _inputs(device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    x = torch.randn(2, 8, 16, device=device, dtype=dtype)
    mask = torch.zeros(2, 1, 1, 8, device=device, dtype=dtype)
    mask[1, ..., 6:] = float("-inf")  # padding in the second sequence
    return x, mask


def _attention_nodes(optimized):
    return [n for c in optimized.captured for n in c.forward.graph.nodes if n.target is attention_inference]


def test_the_op_equals_sdpa_and_only_takes_calls_it_can_make():
    q, k, v = (torch.randn(2, 2, 8, 4) for _ in range(3))
    got = redirect_attention((q, k, v), {"is_causal": True, "scale": 0.3}, devices=("cpu",))
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3))
    assert redirect_attention((q, k, v), {}) is None  # a CPU query: not redirected by default
    assert redirect_attention((q, k, v), {"enable_gqa": True}, devices=("cpu",)) is None
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast casts SDPA's inputs: left to it
        assert redirect_attention((q, k, v), {}, devices=("cpu",)) is None


def test_an_inference_capture_keeps_sdpa_whole_and_equal(monkeypatch):
    monkeypatch.setitem(rnn_op._REDIRECTS, F.scaled_dot_product_attention,
                        functools.partial(redirect_attention, devices=("cpu",)))
    model, inputs = Attention().eval(), _inputs()
    with torch.no_grad():
        optimized = fxdream.optimize(model, inputs, passes=[], cost=None)
        assert len(_attention_nodes(optimized)) == 1
        torch.testing.assert_close(optimized(*inputs), model(*inputs))


def test_a_training_capture_is_left_as_torch_traces_it(monkeypatch):
    monkeypatch.setitem(rnn_op._REDIRECTS, F.scaled_dot_product_attention,
                        functools.partial(redirect_attention, devices=("cpu",)))
    model, inputs = Attention(), _inputs()
    optimized = fxdream.optimize(model, inputs, passes=[], cost=None, training=True)
    assert not _attention_nodes(optimized)


@pytest.mark.cuda
def test_on_cuda_fp16_sdpa_is_one_node_and_equal_to_eager():
    model, inputs = Attention().cuda().half().eval(), _inputs("cuda", torch.float16)
    with torch.no_grad():
        optimized = fxdream.optimize(model, inputs, passes=[], cost=None)
        assert len(_attention_nodes(optimized)) == 1
        torch.testing.assert_close(optimized(*inputs), model(*inputs), atol=2e-3, rtol=2e-3)


@pytest.mark.cuda
def test_captured_in_a_cuda_graph_it_leaves_cudnn_out_and_replays_equal():
    q, k, v = (torch.randn(2, 4, 64, 32, device="cuda", dtype=torch.float16) for _ in range(3))
    mask = torch.zeros(2, 1, 1, 64, device="cuda", dtype=torch.float16)
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        attention_inference(q, k, v, mask, 0.0, False, None)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_inference(q, k, v, mask, 0.0, False, None)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, atol=2e-3, rtol=2e-3)
