"""Circular padding stays one op in inference graphs (fxdream.pad_op), bit-equal to eager."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxdream
from fxdream.ops.pad import pad_inference


class Pad(nn.Module):
    def __init__(self, pad, mode="circular"):
        super().__init__()
        self.pad, self.mode = pad, mode

    def forward(self, x):
        return F.pad(x * 2, self.pad, mode=self.mode) + 1


class PadWithKwargs(Pad):
    """**kwargs keep torch.fx off: the dynamo path."""
    def forward(self, x, **unused):
        return super().forward(x)


def _targets(optimized):
    return [n.target for c in optimized.captured for n in c.forward.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("shape, pad", [((2, 3, 10), (2, 1)), ((2, 3, 6, 7), (1, 2, 3, 0)),
                                        ((1, 2, 4, 5, 6), (1, 1, 2, 2, 0, 1)), ((2, 3, 6, 7), (-1, 2, 1, -2))],
                         ids=["1d", "2d", "3d", "negative"])
@pytest.mark.parametrize("cls", [Pad, PadWithKwargs], ids=["torch.fx", "dynamo"])
def test_a_circular_pad_is_one_op_in_inference_and_bit_equal_to_eager(shape, pad, cls):
    model, x = cls(pad).eval(), torch.randn(*shape)
    expected = model(x)
    optimized = fxdream.optimize(model, (x,), cost=None)
    targets = _targets(optimized)
    assert targets.count(pad_inference) == 1 and "aten.slice_scatter.default" not in map(str, targets)
    actual = optimized(x)
    assert torch.equal(actual, expected) and actual.stride() == expected.stride()


def test_the_other_padding_modes_are_traced_as_they_are():
    for mode in ("constant", "reflect", "replicate"):
        optimized = fxdream.optimize(Pad((1, 2, 1, 1), mode).eval(), (torch.randn(1, 2, 5, 5),), cost=None)
        assert pad_inference not in _targets(optimized), mode


@pytest.mark.parametrize("cost", [None, "analytic"], ids=["prepacked-channels_last", "chosen"])
def test_a_circular_padded_conv_fuses_and_equals_eager_but_training_keeps_torchs_decomposition(cost):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, padding_mode="circular", bias=False), nn.BatchNorm2d(8),
                          nn.ReLU()).eval()
    x = torch.randn(2, 3, 9, 9).contiguous(memory_format=torch.channels_last)
    with torch.no_grad():
        expected = model(x)
    optimized = fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"], cost=cost)
    assert pad_inference in _targets(optimized)
    torch.testing.assert_close(optimized(x), expected, rtol=1e-4, atol=1e-5)
    training = fxdream.optimize(model.train(), (x,), training=True, cost=None)
    assert pad_inference not in _targets(training)
    training(x).sum().backward()
    assert model[0].weight.grad is not None


def test_the_op_passes_opcheck():
    for x, pad in [(torch.randn(2, 3, 6, 7), [1, 2, 3, 0]),
                   (torch.randn(2, 3, 6, 7).contiguous(memory_format=torch.channels_last), [2, 2, 1, 1])]:
        torch.library.opcheck(pad_inference, (x, pad, "circular"), test_utils=("test_schema", "test_faketensor"))
