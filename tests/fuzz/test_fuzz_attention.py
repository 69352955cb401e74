"""Property: fuse_attention fuses exactly the spellings SDPA computes, and stays equal to eager.

Random attention layers (tests/fuzz/attention.py: heads, scale spelled three ways or absent, no
mask, an additive mask, a causal masked_fill(-inf), a mask added before the scale, the
probabilities used twice, dropout) on random (T, F) inputs, in inference.
"""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from .attention import attention_layer
from .nets import L, NetSpec
from .test_fuzz_optimize import FAST, WITH_PASSES, _close, _optimize

SDPA = torch.ops.aten.scaled_dot_product_attention.default


@st.composite
def attention_nets(draw):
    steps, features = draw(st.integers(1, 6)), draw(st.integers(1, 16))
    layer = L(**draw(attention_layer(features, steps)))
    return NetSpec("mlp", draw(st.integers(1, 3)), (steps, features), (layer,), None, draw(st.integers(0, 2**16)))


@settings(max_examples=12, **FAST)
@given(spec=attention_nets())
def test_fuse_attention_fuses_what_sdpa_computes_and_equals_eager(spec):
    model, inputs = spec.build()
    model.eval()
    attention = spec.layers[0]
    optimized = _optimize(model, inputs, ["fuse_attention"], False, None)
    graph = optimized.rewritten_graphs.get((0, "fw"))
    fused = 0 if graph is None else sum(n.target is SDPA for n in graph.graph.nodes)
    mask_scaled = attention.mask == "mask_then_scale" and attention.scale in ("div", "mul")
    expected = int(not mask_scaled and attention.output == "plain")
    assert fused == expected, (spec.describe(), optimized.report.capture, optimized.report.fallback_reason,
                               [r.reason for r in optimized.report.passes])
    with torch.no_grad():
        _close(optimized(*inputs), model(*inputs), WITH_PASSES, "output", check_layout=True)
