"""``optimize(verify=True)``: the module against eager on the example, outputs and gradients,
each side on its own copy of the inputs; a difference says where it comes from."""
import warnings

import pytest
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn

import fxdream
from fxdream.numerics import difference, max_abs_diff


class AddsToItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        x.add_(1.0)
        return self.linear(x)


class ReluOnItsInput(AddsToItsInput):
    def forward(self, x):
        return self.linear(x.relu_())


def test_a_forward_that_updates_its_input_is_verified_equal():
    torch.manual_seed(0)
    model, x = AddsToItsInput().eval(), torch.randn(4, 8)
    before = x.clone()
    report = fxdream.optimize(model, (x,), verify=True).report
    assert report.verified_max_abs_diff == 0.0 and not report.verified_beyond_rounding
    torch.testing.assert_close(x, before)  # the check ran on copies


def test_a_training_forward_that_updates_its_input_is_built_and_verified():
    torch.manual_seed(0)
    model = ReluOnItsInput().train()
    for x in (torch.randn(4, 8), torch.randn(4, 8, requires_grad=True) * 1.0):  # the second: no leaf, as
        report = fxdream.optimize(model, (x,), training=True, verify=True, eager_check=False).report  # eager
        assert report.verified_max_abs_diff < 1e-5                                     # takes it


class ReentrantCheckpoint(nn.Module):
    def __init__(self):
        super().__init__()
        self.block, self.head = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.head(checkpoint.checkpoint(self.block, x, use_reentrant=True) + x)


class PlainBlock(ReentrantCheckpoint):
    """The same math without the checkpoint: the block's gradients are kept."""
    def forward(self, x):
        return self.head(self.block(x) + x)


def test_a_gradient_on_one_side_only_counts_as_a_difference_and_is_named():
    torch.manual_seed(0)
    model, x = ReentrantCheckpoint().train(), torch.randn(4, 8)
    with_grads = PlainBlock().train()
    with_grads.load_state_dict(model.state_dict())
    causes = []
    diff = max_abs_diff(model, with_grads, (x,), training=True, causes=causes)
    assert diff > 0.1  # the block's gradients, against eager's None
    assert causes and causes[0].startswith("block.weight, block.bias: a gradient on one side only (eager's is None)")
    causes.clear()
    assert max_abs_diff(with_grads, with_grads, (x,), training=True, causes=causes) == 0.0 and not causes


class KeepsItsActivation(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second, self.last = nn.Linear(8, 16), nn.Linear(16, 3), None

    def forward(self, x):
        self.last = torch.relu(self.first(x))  # in autograd's graph: copy.deepcopy refuses it
        return self.second(self.last)


def test_verify_copies_a_model_that_keeps_a_tensor_of_autograds_graph():
    x = torch.randn(4, 8)
    weight_normed = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the hook-based weight_norm is deprecated, still used
        nn.utils.weight_norm(weight_normed[0])
    for model in (KeepsItsActivation(), weight_normed):
        model(x)  # the tensor is there before the build
        optimized = fxdream.optimize(model.train(), (x,), training=True, verify=True)
        assert optimized.report.verified_max_abs_diff == pytest.approx(0.0, abs=1e-5)


class MasksScores(nn.Module):
    """Attention-style scores masked to -inf, and a log that makes NaN: equal on both sides."""
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x):
        scores = self.linear(x)
        return scores.masked_fill(scores < 0, float("-inf")), torch.log(scores), scores / 0.0


def test_nan_and_inf_where_eager_has_them_are_no_difference():
    torch.manual_seed(0)
    model, x = MasksScores().eval(), torch.randn(4, 8)
    report = fxdream.optimize(model, (x,), passes=(), verify=True).report
    assert report.verified_max_abs_diff == 0.0 and not report.verified_beyond_rounding

    class NanOnOneSide(MasksScores):
        def forward(self, x):
            masked, logs, ratio = super().forward(x)
            return masked, logs.nan_to_num(0.0), ratio
    other = NanOnOneSide().eval()
    other.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert max_abs_diff(model, other, (x,), training=False) == float("inf")


class Amplifies(nn.Module):
    def __init__(self, gain: float):
        super().__init__()
        self.linear, self.gain = nn.Linear(8, 8), gain

    def forward(self, x):
        return self.linear(x) * self.gain


def test_a_difference_counts_as_rounding_at_the_outputs_own_magnitude():
    torch.manual_seed(0)
    x, models = torch.randn(4, 8), [Amplifies(gain).eval() for gain in (1e5, 1e5 * (1 + 1e-6), 1.0, 1.5)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    with torch.no_grad():
        rounding = difference(models[0], models[1], (x,), training=False)
        wrong = difference(models[2], models[3], (x,), training=False)
    assert rounding.max_abs > 1e-2 and rounding.max_scaled < 1e-5  # float32 rounding of values ~1e5
    assert wrong.max_scaled > 0.1  # a wrong result stays one at any magnitude
