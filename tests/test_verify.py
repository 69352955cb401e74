"""``optimize(verify=True)``: the module against eager on the example, outputs and gradients,
each side on its own copy of the inputs; a difference says where it comes from."""
import torch
import torch.utils.checkpoint as checkpoint
from torch import nn

import fxdream
from fxdream.numerics import max_abs_diff


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
