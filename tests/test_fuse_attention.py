"""fuse_attention: matmul → scale → (+ mask) → softmax → matmul becomes one SDPA call in inference."""
import math

import pytest
import torch
import torch.nn as nn

import fxdream
from fxdream import models
from fxdream.ir.flops import node_flops
from fxdream.passes.fuse_attention import FULLY_MASKED_ROWS

SDPA = torch.ops.aten.scaled_dot_product_attention.default


class Attention(nn.Module):
    """Attention as pre-SDPA code wrote it; the variants the pass must (not) match."""

    def __init__(self, variant="div", heads=2, dim=16):
        super().__init__()
        self.variant, self.heads = variant, heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.drop = nn.Dropout(0.1)

    def forward(self, x, mask=None):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        scores = torch.matmul(q, k.transpose(-2, -1))
        if self.variant == "mul":
            scores = scores * (1 / math.sqrt(d // self.heads))
        elif self.variant == "unscaled_mask_first":
            scores = (scores + mask) / math.sqrt(d // self.heads)  # the mask is scaled too: not SDPA
        else:
            scores = scores / math.sqrt(d // self.heads)
        if mask is not None and self.variant != "unscaled_mask_first":
            scores = scores + mask
        probs = self.drop(scores.softmax(-1))
        out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, d)
        return (out, probs) if self.variant == "weights" else out


def _fused(model, inputs):
    optimized = fxdream.optimize(model.eval(), inputs, passes=["fuse_attention"], cost=None)
    graph = optimized.rewritten_graphs.get((0, "fw"))
    count = 0 if graph is None else sum(n.target is SDPA for n in graph.graph.nodes)
    return optimized, count


@pytest.mark.parametrize("variant,with_mask,fused", [
    ("div", False, 1), ("mul", False, 1), ("div", True, 1),
    ("weights", False, 0),              # the probabilities are an output too
    ("unscaled_mask_first", True, 0),   # (scores + mask) / c is not SDPA's scale·scores + mask
])
def test_matched_blocks_are_fused_and_every_variant_equals_eager(variant, with_mask, fused):
    torch.manual_seed(0)
    model, x = Attention(variant), torch.randn(2, 5, 16)
    inputs = (x, torch.randn(2, 1, 5, 5)) if with_mask else (x,)
    optimized, count = _fused(model, inputs)
    assert count == fused
    (row,) = optimized.report.passes
    assert row.applied == bool(fused)
    if not fused:  # it saw the block and says why it left it
        assert row.reason.startswith("1 matmul → softmax → matmul block(s), none in the form SDPA computes")
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs), model(*inputs), rtol=1e-5, atol=1e-6)


class CausalPrescaled(nn.Module):
    """GPT style: q scaled before the matmul, a causal tril buffer, masked_fill(-inf)."""
    def __init__(self, dim=16, heads=2, fill=float("-inf")):
        super().__init__()
        self.heads, self.fill = heads, fill
        self.qkv = nn.Linear(dim, 3 * dim)
        self.register_buffer("tril", torch.tril(torch.ones(8, 8, dtype=torch.bool)))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        scores = (q * (d // self.heads) ** -0.5) @ k.transpose(-2, -1)
        scores = scores.masked_fill(~self.tril[:s, :s], self.fill)
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, d)


@pytest.mark.parametrize("fill,fused", [(float("-inf"), 1), (-1e4, 0)])  # -1e4: not what SDPA's mask does
def test_a_causal_masked_fill_becomes_a_boolean_mask(fill, fused):
    torch.manual_seed(0)
    model, x = CausalPrescaled(fill=fill), torch.randn(2, 6, 16)
    optimized, count = _fused(model, (x,))
    assert count == fused
    assert (FULLY_MASKED_ROWS in optimized.report.passes[0].notes) == bool(fused)
    assert (FULLY_MASKED_ROWS in optimized.report.to_markdown()) == bool(fused)  # the printed report too
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), rtol=1e-5, atol=1e-6)


def test_bert_blocks_are_fused_with_their_layers_named():
    model, inputs, _ = models.build("bert_base", 2, tiny=True)
    optimized, count = _fused(model, inputs)
    (row,) = optimized.report.passes
    assert count == 2 and row.reason == "2 attention block(s) → scaled_dot_product_attention"
    assert row.notes == ("bert.encoder.layer.0.attention.self", "bert.encoder.layer.1.attention.self")
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs), model(*inputs), rtol=1e-5, atol=1e-6)


def test_training_is_left_alone():
    model, inputs, _ = models.build("bert_base", 2, tiny=True)
    optimized = fxdream.optimize(model, inputs, passes=["fuse_attention"], training=True, cost=None)
    assert not any(r.applied for r in optimized.report.passes)
    assert optimized.report.passes[0].reason.startswith("inference forward graphs only")


def test_the_fused_op_has_the_two_matmuls_flops_and_a_gpu_prediction_gains():
    model, inputs, _ = models.build("bert_base", 2, tiny=True)
    optimized, _ = _fused(model, inputs)
    (sdpa,) = [n for n in optimized.rewritten_graphs[(0, "fw")].graph.nodes if n.target is SDPA][:1]
    b, h, s, d = sdpa.args[0].meta["val"].shape
    assert node_flops(sdpa) == 2 * b * h * s * s * (d + d)
    before = fxdream.simulate(model.eval(), inputs, device="h100", training=False)
    after = fxdream.simulate(model.eval(), inputs, device="h100", training=False, passes=["fuse_attention"])
    assert after.time_ms < before.time_ms  # predicted: fewer kernels and no [s, s] round trips


class TwoStacked(nn.Module):
    """The first block's [b, h, s, d] output is the second block's query, as it is."""
    def forward(self, q, k, v):
        first = torch.matmul((torch.matmul(q, k.transpose(-2, -1)) / 4.0).softmax(-1), v)
        return torch.matmul((torch.matmul(first, k.transpose(-2, -1)) / 4.0).softmax(-1), v)


def test_a_block_feeding_the_next_is_fused_in_both():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 3, 5, 4) for _ in range(3))
    optimized, count = _fused(TwoStacked(), (q, k, v))
    assert count == 2
    with torch.no_grad():
        torch.testing.assert_close(optimized(q, k, v), TwoStacked()(q, k, v), rtol=1e-5, atol=1e-6)


class HeadsFolded(nn.Module):
    """The output viewed as [b·h, s, d] (after a pointwise op, which keeps its layout): a view
    only the bmm's contiguous result allows."""
    def __init__(self, scaled: bool):
        super().__init__()
        self.scaled = scaled

    def forward(self, x, heads=2):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, heads, d // heads).transpose(1, 2) for t in x.repeat(1, 1, 3).chunk(3, -1))
        out = torch.matmul((torch.matmul(q, k.transpose(-2, -1)) / 2.0).softmax(-1), v)
        return (out * 3.0 if self.scaled else out).view(b * heads, s, d // heads)


@pytest.mark.parametrize("scaled", [False, True])
def test_sdpa_output_is_made_contiguous_where_a_later_view_needs_it(scaled):
    x = torch.randn(2, 5, 16)
    optimized, count = _fused(HeadsFolded(scaled), (x,))
    assert count == 1 and optimized.report.fallback_reason is None  # SDPA's output follows q's layout:
    graph = optimized.rewritten_graphs[(0, "fw")].graph                # (b, s, h, d) here
    (sdpa,) = [n for n in graph.nodes if n.target is SDPA]
    assert [u.target for u in sdpa.users] == [torch.ops.aten.clone.default]
    with torch.no_grad():
        actual, expected = optimized(x), HeadsFolded(scaled)(x)
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)
    assert actual.stride() == expected.stride()


def test_sdpa_output_is_left_as_it_is_where_nothing_sees_its_layout():
    model, inputs, _ = models.build("bert_base", 1, tiny=True)  # permute → clone → view after each block
    optimized, count = _fused(model, inputs)
    sdpas = [n for n in optimized.rewritten_graphs[(0, "fw")].graph.nodes if n.target is SDPA]
    assert count == 2 and all(u.target is torch.ops.aten.permute.default for n in sdpas for u in n.users)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bert_attention_is_fused_on_cuda_and_equals_eager():
    model, inputs, _ = models.build("bert_base", 4, tiny=True, device="cuda")
    optimized, count = _fused(model, inputs)
    assert count == 2
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)  # TF32 / flash


class MaskedScores(nn.Module):
    """softmax(q·kᵀ·c + mask) · v with the mask a buffer (a constant of the model) or an input;
    ``alpha`` weights the mask (``torch.add(..., alpha=)``), which SDPA does not."""
    def __init__(self, mask=None, alpha=1.0):
        super().__init__()
        self.alpha = alpha
        if mask is not None:
            self.register_buffer("mask", mask)

    def forward(self, q, k, v, mask=None):
        mask = self.mask if mask is None else mask
        scores = torch.add(torch.matmul(q, k.transpose(-1, -2)) * 0.25, mask, alpha=self.alpha)
        return torch.matmul(torch.softmax(scores, -1), v)


def _qkv():
    torch.manual_seed(0)
    return tuple(torch.randn(3, 2, 6, 8) for _ in range(3))


def test_a_mask_weighted_by_alpha_is_not_matched():
    model, qkv = MaskedScores(torch.randn(1, 1, 6, 6), alpha=2.0), _qkv()
    optimized, count = _fused(model, qkv)
    assert count == 0 and optimized.report.passes[0].reason.startswith("1 matmul → softmax → matmul block(s), none")
    with torch.no_grad():
        assert torch.equal(optimized(*qkv), model(*qkv))


@pytest.mark.parametrize("masked_row", [False, True])
def test_a_constant_mask_is_checked_for_rows_it_masks_whole(masked_row):
    mask = torch.zeros(1, 1, 6, 6)
    mask[..., 1, :3] = float("-inf")
    if masked_row:
        mask[..., 2, :] = float("-inf")  # query row 2 sees no key: eager gives NaN there, SDPA 0
    model, qkv = MaskedScores(mask), _qkv()
    optimized, count = _fused(model, qkv)
    (row,) = optimized.report.passes
    assert count == (0 if masked_row else 1) and FULLY_MASKED_ROWS not in row.notes
    if masked_row:
        assert row.reason == ("1 attention block(s) found, none fused: a constant mask excludes a whole query "
                              "row (eager's softmax gives NaN there, SDPA 0)")
    with torch.no_grad():
        torch.testing.assert_close(optimized(*qkv), model(*qkv), rtol=1e-5, atol=1e-6, equal_nan=True)


def test_a_mask_given_at_the_call_is_fused_with_the_note():
    model, qkv = MaskedScores(), _qkv()
    inputs = (*qkv, torch.zeros(1, 1, 6, 6))
    optimized, count = _fused(model, inputs)
    assert count == 1 and FULLY_MASKED_ROWS in optimized.report.passes[0].notes
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs), model(*inputs), rtol=1e-5, atol=1e-6)


class HalfAttention(nn.Module):
    """q, k, v in half precision; the mask float32, added and softmaxed in float32 (HF style)."""

    def __init__(self, tail=None):
        super().__init__()
        self.tail = tail

    def forward(self, q, k, v, mask):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        out = (scores + mask).softmax(-1).to(q.dtype) @ v
        if self.tail == "as_strided":  # equal to reshape(b, -1) on the matmul's contiguous output
            return torch.as_strided(out, (out.shape[0], out[0].numel()), (out[0].numel(), 1)) + 0.0
        return out


def _half_case(dtype, seq=8):
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, seq, 16, dtype=dtype) for _ in range(3))
    mask = torch.zeros(1, 1, seq, seq)
    mask[..., 3, :] = torch.finfo(torch.float32).min  # query row 3 sees no key: eager averages v
    mask[..., :, 6:] = torch.finfo(torch.float32).min
    return q, k, v, mask


def test_a_float32_lowest_mask_beside_bf16_queries_stays_finite_in_the_fused_call():
    model, args = HalfAttention().eval(), _half_case(torch.bfloat16)
    fast = fxdream.optimize(model, args, passes=["fuse_attention"], eager_check=False, cost=None)
    assert fast.report.passes[0].applied
    with torch.no_grad():
        out, expected = fast(*args), model(*args)
    torch.testing.assert_close(out[:, :, 3], expected[:, :, 3], atol=1e-2, rtol=1e-2)  # not 0
    torch.testing.assert_close(out, expected, atol=1e-2, rtol=1e-2)


def test_a_float32_mask_beside_fp16_queries_is_left_as_it_is():
    """float16's range loses the mask's lowest values: a fully masked row would differ."""
    model, args = HalfAttention().eval(), _half_case(torch.float16)
    fast = fxdream.optimize(model, args, passes=["fuse_attention"], eager_check=False, cost=None)
    assert not fast.report.passes[0].applied
    with torch.no_grad():
        torch.testing.assert_close(fast(*args), model(*args))


def test_an_as_strided_of_the_output_reads_the_matmuls_layout():
    """q, k, v as heads split from a linear layer's output: SDPA's output is [b, s, h, d] in
    memory where the matmul's was contiguous."""
    q, k, v, mask = _half_case(torch.float32)
    model, args = HalfAttention("as_strided").eval(), (*(t.transpose(1, 2).contiguous().transpose(1, 2)
                                                         for t in (q, k, v)), mask)
    fast = fxdream.optimize(model, args, passes=["fuse_attention"], eager_check=False, cost=None)
    assert fast.report.passes[0].applied
    with torch.no_grad():
        torch.testing.assert_close(fast(*args), model(*args))


def test_blocks_sdpa_cannot_take_are_declined_not_raised():
    q, k, v, _ = _half_case(torch.float32)
    cases = [(q, k, v, torch.zeros(8)),  # a 1-d mask
             (q, k, v.bfloat16(), torch.zeros(1, 1, 8, 8))]  # value in another dtype
    for args in cases:

        class Mixed(nn.Module):
            def forward(self, q, k, v, mask):
                probs = (q @ k.transpose(-2, -1) / 4 + mask).softmax(-1)
                return probs.to(v.dtype) @ v
        fast = fxdream.optimize(Mixed().eval(), args, passes=["fuse_attention"], eager_check=False, cost=None)
        row = fast.report.passes[0]
        assert not row.applied and "raised" not in row.reason and "none in the form" in row.reason, row.reason


class NarrowSoftmax(nn.Module):
    def forward(self, q, k, v):
        return (q @ k.transpose(-2, -1) / 4).to(torch.bfloat16).softmax(-1).float() @ v


def test_a_softmax_taken_in_a_narrower_dtype_is_not_matched():
    """SDPA's softmax accumulates in float: the model's rounding to bf16 would be lost."""
    q, k, v = (torch.randn(2, 4, 16, 16) for _ in range(3))
    fast = fxdream.optimize(NarrowSoftmax().eval(), (q, k, v), passes=["fuse_attention"], eager_check=False,
                            cost=None)
    assert not fast.report.passes[0].applied


class PlainAttention(nn.Module):
    def forward(self, q, k, v, mask):
        return ((q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])) + mask).softmax(-1) @ v


def test_a_block_reinplace_rewrote_first_is_declined_naming_the_order():
    args = (*(torch.randn(2, 4, 8, 16) for _ in range(3)), torch.randn(2, 1, 8, 8))
    fast = fxdream.optimize(PlainAttention().eval(), args, passes=["reinplace", "fuse_attention"],
                            eager_check=False, cost=None)
    row = next(r for r in fast.report.passes if r.name == "fuse_attention")
    assert not row.applied and row.reason.endswith("name fuse_attention before reinplace"), row.reason
    fast = fxdream.optimize(PlainAttention().eval(), args, passes=["fuse_attention", "reinplace"],
                            eager_check=False, cost=None)
    assert next(r for r in fast.report.passes if r.name == "fuse_attention").applied
