"""Property: 1-d and 3-d conv nets through fuse_conv_bias_act and prepack_linear equal eager.

A net is drawn as a tuple of blocks (plain data: paste a falsifying example into a test as is):
``("conv", cout, k, stride, dilation, groups, bias, bn, act)`` or ``("res", bn, act, post)``
(conv → [bn] → act → conv → [bn], plus the input, then ``post``), then a head (mean over the
positions → Linear). In inference the passes' default variants run (no cost model: 1-d convs
as 2-d ones of height 1, NLC inside; 3-d ones channels_last_3d, weights prepacked); in training
the trainable fused ops run, and every gradient must match eager's.
"""
from __future__ import annotations

import copy

import torch
import torch.nn as nn
from hypothesis import given, settings
from hypothesis import strategies as st

from .test_fuzz_optimize import FAST, WITH_PASSES, _close, _optimize

ACTS = {"relu": nn.ReLU, "relu6": nn.ReLU6, "silu": nn.SiLU, "gelu": nn.GELU, None: nn.Identity}
PASSES = ["fuse_conv_bias_act", "prepack_linear"]


@st.composite
def conv_nets(draw):
    dims = draw(st.sampled_from([1, 3]))
    channels, blocks = draw(st.integers(1, 6)), []
    for _ in range(draw(st.integers(1, 4))):
        if draw(st.booleans()):
            cout, groups = draw(st.integers(1, 3)), draw(st.sampled_from([1, 2]))
            cout *= groups if channels % groups == 0 else 1
            groups = groups if channels % groups == 0 else 1
            blocks.append(("conv", cout, draw(st.sampled_from([1, 3])), draw(st.sampled_from([1, 2])),
                           draw(st.sampled_from([1, 2])), groups, draw(st.booleans()), draw(st.booleans()),
                           draw(st.sampled_from(sorted(ACTS, key=str)))))
            channels = cout
        else:
            blocks.append(("res", draw(st.booleans()), draw(st.sampled_from(["relu", "silu"])),
                           draw(st.sampled_from(["relu", None]))))
    size = draw(st.integers(9, 14)) if dims == 1 else draw(st.integers(5, 7))
    return dims, draw(st.integers(1, 3)), size, tuple(blocks), draw(st.integers(0, 2**16))


class Residual(nn.Module):
    def __init__(self, dims, channels, bn, act, post):
        super().__init__()
        conv = getattr(nn, f"Conv{dims}d")
        norm = getattr(nn, f"BatchNorm{dims}d") if bn else (lambda c: nn.Identity())
        self.body = nn.Sequential(conv(channels, channels, 3, padding=1), norm(channels), ACTS[act](),
                                  conv(channels, channels, 3, padding=1), norm(channels))
        self.post = ACTS[post]()

    def forward(self, x):
        return self.post(self.body(x) + x)


def build(dims, batch, size, blocks, seed):
    torch.manual_seed(seed)
    conv, norm = getattr(nn, f"Conv{dims}d"), getattr(nn, f"BatchNorm{dims}d")
    layers, channels = [], 2
    for block in blocks:
        if block[0] == "conv":
            _, cout, k, stride, dilation, groups, bias, bn, act = block
            groups = groups if channels % groups == 0 and cout % groups == 0 else 1
            layers += [conv(channels, cout, k, stride, padding=dilation * (k // 2), dilation=dilation,
                            groups=groups, bias=bias)] + ([norm(cout)] if bn else []) + [ACTS[act]()]
            channels = cout
        else:
            layers.append(Residual(dims, channels, *block[1:]))
    model = nn.Sequential(*layers, nn.Flatten(2), Mean(), nn.Linear(channels, 3))
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):  # statistics of a trained net
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 1.5)
    return model, (torch.randn(batch, 2, *[size] * dims),)


class Mean(nn.Module):
    def forward(self, x):
        return x.mean(-1)


@settings(max_examples=10, **FAST)
@given(net=conv_nets())
def test_1d_and_3d_conv_nets_equal_eager_in_inference(net):
    model, inputs = build(*net)
    model.eval()
    optimized = _optimize(model, inputs, PASSES, False, None)
    assert optimized.report.fallback_reason is None, optimized.report.fallback_reason
    assert not any("raised" in r.reason for r in optimized.report.passes), [r.reason for r in optimized.report.passes]
    with torch.no_grad():
        _close(optimized(*inputs), model(*inputs), WITH_PASSES, "output", check_layout=True)


@settings(max_examples=6, **FAST)
@given(net=conv_nets())
def test_1d_and_3d_conv_nets_train_like_eager(net):
    model, inputs = build(*net)
    reference = copy.deepcopy(model)
    optimized = _optimize(model, inputs, PASSES, True, None)
    assert not any("raised" in r.reason for r in optimized.report.passes), [r.reason for r in optimized.report.passes]
    out, expected = optimized(*inputs), reference(*inputs)
    _close(out, expected, WITH_PASSES, "output")
    out.square().sum().backward()
    expected.square().sum().backward()
    for (name, p), q in zip(reference.named_parameters(), model.parameters()):
        _close(q.grad, p.grad, WITH_PASSES, f"grad of {name}")
