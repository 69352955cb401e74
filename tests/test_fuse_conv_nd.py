"""fuse_conv_bias_act on 1-d and 3-d convolutions (CPU): BN folded, post-ops and the residual
add fused, weights prepacked; 1-d convs run as 2-d ones of height 1 (NLC inside, NCL at the
edges), 3-d ones in channels_last_3d."""
import pytest
import torch
from torch import nn

import fxdream
from fxdream.ops import fused_conv as ops
from fxdream.passes import fuse_conv_bias_act as fuse

from conftest import assert_same_training_step
from test_fuse_conv_bias_act import PASS, FUSED, fused_targets


class ResidualNd(nn.Module):
    """conv+bn+relu, then conv+bn+add+relu (a residual block), in ``nd`` spatial dimensions."""

    def __init__(self, nd: int, bias: bool):
        super().__init__()
        conv, norm = getattr(nn, f"Conv{nd}d"), getattr(nn, f"BatchNorm{nd}d")
        self.conv1, self.conv2 = conv(4, 8, 3, padding=1, bias=bias), conv(8, 8, 3, padding=1, bias=bias)
        self.bn1, self.bn2 = norm(8), norm(8)

    def forward(self, x):
        y = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(y)) + y)


@pytest.mark.parametrize("nd,targets", [
    (1, [ops.conv_fused_inference_prepacked] * 2),  # the wrapper runs a 1-d conv as 2-d over height 1
    (3, [ops.ONEDNN_CONV, ops.conv_fused_inference_prepacked])])  # conv2's residual is conv2's input
def test_1d_and_3d_convolutions_fold_and_fuse_prepacked(nd, targets):
    """1-d convs run as 2-d ones of height 1, so they get prepacked weights and channels_last
    (NLC) activations; 3-d convs get prepacked weights and channels_last_3d."""
    torch.manual_seed(0)
    model, x = ResidualNd(nd, bias=False).eval(), torch.randn(2, 4, *[6] * nd)
    for bn in (model.bn1, model.bn2):
        bn.running_mean.uniform_(-1, 1), bn.running_var.uniform_(0.5, 2)
    optimized = fxdream.optimize(model, (x,), passes=[PASS], cost=None)
    (row,) = optimized.report.passes
    assert row.applied and row.reason == ("fused 1 conv+bn+relu, 1 conv+bn+add+relu; channels_last+prepacked: "
                                          "no cost model was given, so chosen by default")
    assert fused_targets(optimized.rewritten_graphs[(0, "fw")]) == targets
    with torch.no_grad():
        out = optimized(x)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    assert out.is_contiguous()  # channels-last inside, as it came at the output


class ConvThenTranspose(nn.Module):
    """A 1-d conv feeding a view (transpose, as before an RNN): it must see NCL strides."""

    def __init__(self):
        super().__init__()
        self.conv, self.norm = nn.Conv1d(4, 8, 3, padding=1), nn.BatchNorm1d(8)

    def forward(self, x):
        y = torch.relu(self.norm(self.conv(x)))
        return y.transpose(1, 2).reshape(y.shape[0], -1) * 2


def test_a_1d_conv_output_is_given_back_in_ncl_before_a_view():
    torch.manual_seed(0)
    model, x = ConvThenTranspose().eval(), torch.randn(2, 4, 10)
    optimized = fxdream.optimize(model, (x,), passes=[PASS], cost=None)
    assert "channels_last+prepacked" in optimized.report.passes[0].reason
    graph = optimized.rewritten_graphs[(0, "fw")].graph
    (fused,) = [n for n in graph.nodes if n.target in FUSED]
    (restore,) = fused.users  # NLC → NCL, then the transpose
    assert restore.target is fuse.CLONE and restore.kwargs == {"memory_format": torch.contiguous_format}
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("nd", [1, 3])
def test_1d_and_3d_training_step_equals_eager(nd):
    torch.manual_seed(0)
    model, x = ConvAddReluNd(nd), torch.randn(2, 3, *[6] * nd)
    optimized = fxdream.optimize(model, (x,), passes=[PASS], training=True, cost=None)
    assert "1 conv+bias+relu, 1 conv+bias+add+relu" in optimized.report.passes[0].reason
    assert set(fused_targets(optimized.rewritten_graphs[(0, "fw")])) == set(ops.FUSED_OPS[:2])
    assert assert_same_training_step(model, optimized, (x,), atol=1e-5) == 4


class ConvAddReluNd(nn.Module):
    def __init__(self, nd: int):
        super().__init__()
        conv = getattr(nn, f"Conv{nd}d")
        self.conv1, self.conv2 = conv(3, 8, 3, padding=1), conv(8, 8, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        return torch.relu(self.conv2(y) + y)


class Residual3d(nn.Module):
    """A stem, then an identity residual block: the block's input is read last by its first conv."""

    def __init__(self):
        super().__init__()
        unit = lambda c_in: [nn.Conv3d(c_in, 8, 3, padding=1, bias=False), nn.BatchNorm3d(8)]  # noqa: E731
        self.stem, self.body = nn.Sequential(*unit(3), nn.ReLU()), nn.Sequential(*unit(8), nn.ReLU(), *unit(8))

    def forward(self, x):
        y = self.stem(x)
        return torch.relu(self.body(y) + y)


def test_a_3d_residual_is_accumulated_in_place_in_channels_last_3d():
    torch.manual_seed(0)
    model, x = Residual3d().eval(), torch.randn(2, 3, 4, 6, 6)
    optimized = fxdream.optimize(model, (x,), passes=[PASS], cost=None)
    assert fused_targets(optimized.rewritten_graphs[(0, "fw")]) == [ops.ONEDNN_CONV] * 2 + [ops.ONEDNN_CONV_ADD_]
    with torch.no_grad():
        out = optimized(x)
    torch.testing.assert_close(out, model(x), atol=1e-5, rtol=1e-5)
    assert out.is_contiguous()


class Conv1dGroupNorm(nn.Module):
    """Wav2Vec2's feature encoder: conv1d → GroupNorm → GELU → conv1d → GELU."""

    def __init__(self):
        super().__init__()
        self.conv0, self.norm = nn.Conv1d(1, 8, 10, stride=5, bias=False), nn.GroupNorm(8, 8)
        self.conv1 = nn.Conv1d(8, 8, 3, stride=2, bias=False)

    def forward(self, x):
        h = nn.functional.gelu(self.norm(self.conv0(x)))
        return nn.functional.gelu(self.conv1(h)).transpose(1, 2)


def test_a_1d_convs_nlc_output_goes_back_to_ncl_before_an_op_that_needs_it():
    # GroupNorm's CPU kernel rejects the (N, L, C) strides a prepacked 1-d conv returns: the
    # prepacked build restores them before it (a pointwise op or another fused conv takes them)
    torch.manual_seed(0)
    model, x = Conv1dGroupNorm().eval(), torch.randn(2, 1, 200)
    with torch.no_grad():
        expected = model(x)
    optimized = fxdream.optimize(model, (x,), passes=[PASS], cost=None)
    (row,) = optimized.report.passes
    assert row.applied and "channels_last+prepacked" in row.reason, row.reason
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), expected, atol=1e-5, rtol=1e-5)
        compiled = torch.compile(model, backend="fxdream", options={"passes": [PASS], "cost": None})
        torch.testing.assert_close(compiled(x), expected, atol=1e-5, rtol=1e-5)
    graph = optimized.rewritten_graphs[(0, "fw")].graph
    norm = next(n for n in graph.nodes if n.target is torch.ops.aten.native_group_norm.default)
    assert norm.args[0].meta["val"].is_contiguous()
