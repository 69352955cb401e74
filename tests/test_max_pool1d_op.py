"""1-d max pooling stays one op in inference graphs (fxdream.max_pool1d_op), bit-equal to eager."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxdream
from fxdream.ops.max_pool1d import max_pool1d_inference

CASES = [dict(kernel_size=3), dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=4, stride=3, ceil_mode=True),
         dict(kernel_size=2, dilation=2, padding=1, ceil_mode=True), dict(kernel_size=(5,), stride=(1,))]


class Pool(nn.Module):
    def __init__(self, keywords):
        super().__init__()
        self.conv, self.keywords = nn.Conv1d(4, 6, 3), keywords

    def forward(self, x):
        return F.max_pool1d(torch.relu(self.conv(x)), **self.keywords) * 2


class PoolWithKwargs(Pool):
    """**kwargs keep torch.fx off: the dynamo path."""
    def forward(self, x, **unused):
        return super().forward(x)


def _targets(optimized):
    return [n.target for c in optimized.captured for n in c.forward.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("keywords", CASES, ids=[str(i) for i in range(len(CASES))])
@pytest.mark.parametrize("cls", [Pool, PoolWithKwargs], ids=["torch.fx", "dynamo"])
@pytest.mark.parametrize("length", [17, 32])
def test_max_pool1d_is_one_op_in_inference_and_bit_equal_to_eager(keywords, cls, length):
    torch.manual_seed(0)
    model, x = cls(keywords).eval(), torch.randn(2, 4, length)
    with torch.no_grad():
        expected = model(x)
    optimized = fxdream.optimize(model, (x,), cost=None)
    targets = _targets(optimized)
    assert targets.count(max_pool1d_inference) == 1
    assert "aten.max_pool2d_with_indices.default" not in map(str, targets)
    actual = optimized(x)
    assert torch.equal(actual, expected) and actual.stride() == expected.stride()


def test_the_module_unbatched_inputs_and_indices():
    x = torch.randn(4, 20)  # unbatched: (channels, length)
    pool = nn.MaxPool1d(3, 2).eval()
    optimized = fxdream.optimize(pool, (x,), cost=None)
    assert max_pool1d_inference in _targets(optimized) and torch.equal(optimized(x), pool(x))
    with_indices = nn.MaxPool1d(3, 2, return_indices=True).eval()  # indices: traced as torch traces it
    optimized = fxdream.optimize(with_indices, (x[None],), cost=None)
    assert max_pool1d_inference not in _targets(optimized)
    assert all(torch.equal(a, b) for a, b in zip(optimized(x[None]), with_indices(x[None])))


def test_training_keeps_torchs_differentiable_path():
    model, x = Pool(dict(kernel_size=3)), torch.randn(2, 4, 17)
    optimized = fxdream.optimize(model, (x,), training=True, cost=None)
    assert max_pool1d_inference not in _targets(optimized)
    optimized(x).sum().backward()
    assert model.conv.weight.grad is not None


def test_the_op_passes_opcheck():
    for args in [(torch.randn(2, 3, 17), 3, 2, 1, 1, True), (torch.randn(3, 9), 2, 2, 0, 2, False)]:
        torch.library.opcheck(max_pool1d_inference, args, test_utils=("test_schema", "test_faketensor"))
