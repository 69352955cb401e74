"""An inference module whose weights change in place after the build runs its graphs as captured
(reading the weights live) instead of the rewritten ones, which hold folded and packed copies."""
import copy

import pytest
import torch

import fxdream
from conftest import ConvBnNet

CHANGED = "the model's weights changed in place after the build"


def _built():
    torch.manual_seed(0)
    model, x = ConvBnNet().eval(), torch.randn(2, 3, 8, 8)
    return model, x, fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"])


def _changed(report) -> bool:
    return any(CHANGED in note for note in report.notes)


def test_calls_after_the_build_run_the_rewritten_graphs():
    model, x, optimized = _built()
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(optimized(x), model(x))
    assert optimized.report.passes[0].applied and not _changed(optimized.report)


@pytest.mark.parametrize("change", ["optimizer step", "load_state_dict", "batchnorm statistics in train mode",
                                    "weight.data reassigned"])
def test_weights_changed_in_place_are_seen(change):
    model, x, optimized = _built()
    if change == "weight.data reassigned":  # new memory, the same version counter
        model.conv.weight.data = model.conv.weight.data * 2
    elif change == "optimizer step":
        model.conv.weight.grad = torch.ones_like(model.conv.weight)
        torch.optim.SGD(model.parameters(), lr=0.1).step()
    elif change == "load_state_dict":
        state = {k: v + 0.25 if v.is_floating_point() else v for k, v in model.state_dict().items()}
        model.load_state_dict(state)
    else:  # calls in train mode update the running statistics BatchNorm was folded from
        optimized.train()
        with torch.no_grad():
            optimized(x * 3 + 1)
        optimized.eval()
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))
    assert _changed(optimized.report)
    # the row no longer claims the rewrite (nor its predicted gain): the graph runs as captured
    row = optimized.report.passes[0]  # the build's graph (a call in train mode captures one more)
    assert (row.graph_index, row.phase) == (0, "fw") and not row.applied and row.predicted_delta_us is None
    assert row.reason.startswith(f"applied, but {CHANGED}; the graph runs as captured: fused")
    assert (0, "fw") not in optimized.rewritten_graphs


class ConvBnNetWithKwargs(ConvBnNet):
    """**kwargs keep torch.fx off: the dynamo path, whose eval graphs do not take BN's batch count."""
    def forward(self, x, **unused):
        return super().forward(x)


@pytest.mark.parametrize("cls", [ConvBnNet, ConvBnNetWithKwargs], ids=["torch.fx", "dynamo"])
def test_batchnorm_statistics_updated_by_eager_train_mode_calls_are_seen(cls):
    # BatchNorm's kernel updates running_mean/var without bumping their version: its count tells
    torch.manual_seed(0)
    model, x = cls().eval(), torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"])
    model.train()
    with torch.no_grad():
        model(x * 3 + 1)  # eager: recalibrates the statistics
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))
    assert _changed(optimized.report)


@pytest.mark.parametrize("change", ["a submodule replaced", "load_state_dict(assign=True)",
                                    "buffers rebound by half().float()"])
def test_a_model_whose_tensors_or_modules_were_replaced_runs_as_it_now_is(change):
    """The torch.fx trace read the model's parameters, buffers and submodules once; a model that
    replaced one since is captured again (through dynamo), not run as traced."""
    model, x, optimized = _built()
    assert optimized.report.capture.startswith("torch.fx")
    if change == "a submodule replaced":
        model.conv = torch.nn.Conv2d(model.conv.in_channels, model.conv.out_channels, model.conv.kernel_size,
                                     padding=model.conv.padding)
    elif change == "load_state_dict(assign=True)":
        state = {k: (v + 0.25 if v.is_floating_point() else v).clone() for k, v in model.state_dict().items()}
        model.load_state_dict(state, assign=True)
    else:  # rounds every weight through float16 and gives each buffer a new tensor
        model.half().float()
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))



def test_a_model_made_under_inference_mode_builds_and_says_what_it_cannot_watch():
    """Its buffers are inference tensors: a build's throw-away step restores them inside
    inference mode (outside it torch refuses the write), and, with no version counters, the
    report says a later in-place change is not seen."""
    torch.manual_seed(0)
    with torch.inference_mode():
        model, x = ConvBnNet().eval(), torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"])
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))
    assert any("torch.inference_mode()" in note and "not seen" in note for note in optimized.report.notes)


class CountingNet(torch.nn.Module):
    """Counts its own calls in a buffer its forward updates; a conv + BatchNorm the fusion folds."""

    def __init__(self):
        super().__init__()
        self.net = ConvBnNet()
        self.register_buffer("calls", torch.zeros((), dtype=torch.long), persistent=False)

    def forward(self, x):
        self.calls += 1
        return self.net(x)


def test_state_the_forward_updates_itself_is_no_change_after_the_build():
    torch.manual_seed(0)
    model, x = CountingNet().eval(), torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"], verify=True)
    with torch.no_grad():
        for calls in range(1, 4):
            torch.testing.assert_close(optimized(x), model.net(x))
            assert int(model.calls) == calls
    assert optimized.report.passes[0].applied and not _changed(optimized.report)
    with torch.no_grad():
        model.net.conv.weight.mul_(2)  # a real change is still seen
        torch.testing.assert_close(optimized(x), model.net(x))
    assert _changed(optimized.report)


class HalfFrozen(torch.nn.Module):
    """One BatchNorm left in train mode inside an eval model, one folded."""

    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.conv2, self.bn2 = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.BatchNorm2d(8)

    def forward(self, x):
        return torch.relu(self.bn2(self.conv2(torch.relu(self.bn(self.conv(x))))))


def test_a_batchnorm_in_train_mode_counting_its_own_batches_is_no_change():
    torch.manual_seed(0)
    model = HalfFrozen().eval()
    model.bn.train()
    reference = copy.deepcopy(model)
    optimized = fxdream.optimize(model, (torch.randn(3, 4, 6, 6),), passes=["fuse_conv_bias_act"], cost=None)
    with torch.no_grad():
        for _ in range(3):
            x = torch.randn(3, 4, 6, 6)
            torch.testing.assert_close(optimized(x), reference(x))
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean)
    assert int(model.bn.num_batches_tracked) == int(reference.bn.num_batches_tracked) == 3
    assert optimized.report.passes[0].applied and not _changed(optimized.report)
