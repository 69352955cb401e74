"""An attention layer for the fuzzed MLP nets on (T, F) inputs: the spellings fuse_attention
matches and the ones it must leave alone (kept beside nets.py, which is long enough)."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
from hypothesis import strategies as st

SCALES = ("div", "mul", "none", "q")           # scores / √d, scores * d^-½, none, q * d^-½ first
MASKS = ("none", "additive", "causal_fill", "mask_then_scale")  # the last, with a scale: not SDPA
OUTPUTS = ("plain", "with_probs")              # with_probs: the probabilities are used twice


@st.composite
def attention_layer(draw, features: int, steps: int):
    heads = draw(st.sampled_from([h for h in range(1, features + 1) if features % h == 0]))
    return dict(kind="attn", f=features, heads=heads, scale=draw(st.sampled_from(SCALES)),
                mask=draw(st.sampled_from(MASKS)), output=draw(st.sampled_from(OUTPUTS)),
                dropout=draw(st.sampled_from([0.0, 0.25])), steps=steps)


class Attention(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.spec = dict(spec.kw)  # plain data: the spec's L does not deep-copy (the model is copied)
        self.qkv = nn.Linear(spec.f, 3 * spec.f)
        self.drop = nn.Dropout(spec.dropout)
        t = spec.steps
        self.register_buffer("bias", torch.linspace(-1.0, 0.0, t * t).view(1, 1, t, t))
        self.register_buffer("causal", torch.ones(t, t, dtype=torch.bool).triu(1))

    def forward(self, x):
        s = _Fields(self.spec)
        b, t, f = x.shape
        q, k, v = (y.view(b, t, s.heads, f // s.heads).transpose(1, 2) for y in self.qkv(x).chunk(3, -1))
        c = 1 / math.sqrt(f // s.heads)
        if s.scale == "q":
            q = q * c
        scores = q @ k.transpose(-2, -1)
        if s.mask == "mask_then_scale":
            scores = scores + self.bias
        scores = {"div": lambda z: z / (1 / c), "mul": lambda z: z * c}.get(s.scale, lambda z: z)(scores)
        if s.mask == "additive":
            scores = scores + self.bias
        elif s.mask == "causal_fill":
            scores = scores.masked_fill(self.causal, float("-inf"))
        probs = self.drop(scores.softmax(-1))
        out = (probs @ v).transpose(1, 2).reshape(b, t, f)
        return out + probs.mean() if s.output == "with_probs" else out


class _Fields:
    def __init__(self, fields: dict):
        self.__dict__.update(fields)


def describe(spec) -> str:
    return (f"Attention(f={spec.f}, heads={spec.heads}, scale={spec.scale}, mask={spec.mask}, "
            f"output={spec.output}, dropout={spec.dropout})")
