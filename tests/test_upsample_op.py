"""Upsampling stays one op in inference graphs (fxdream.upsample_op), bit-equal to eager."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxdream
from fxdream.ops.upsample import upsample

# (input dims, F.interpolate keywords): every mode F.interpolate sends to a torch._C._nn function
CASES = [
    (4, dict(scale_factor=2, mode="bilinear", align_corners=False)),
    (4, dict(size=(13, 7), mode="bilinear", align_corners=True)),
    (4, dict(scale_factor=1.7, mode="nearest")),
    (4, dict(scale_factor=(2, 3), mode="nearest-exact")),
    (4, dict(size=(9, 11), mode="bicubic", align_corners=False)),
    (4, dict(scale_factor=0.5, mode="bilinear", antialias=True)),
    (4, dict(scale_factor=0.5, mode="bicubic", antialias=True, align_corners=False)),
    (4, dict(scale_factor=2.5, mode="bilinear", recompute_scale_factor=True)),
    (3, dict(scale_factor=3, mode="linear")),
    (3, dict(size=10, mode="nearest")),
    (5, dict(scale_factor=2, mode="trilinear")),
    (5, dict(size=(3, 4, 5), mode="nearest")),
]


class Decoder(nn.Module):
    """A conv, an upsampling, a conv: what a U-Net or FPN decoder does."""

    def __init__(self, dims: int, keywords: dict):
        super().__init__()
        conv = {3: nn.Conv1d, 4: nn.Conv2d, 5: nn.Conv3d}[dims]
        self.a, self.b, self.keywords = conv(3, 4, 1), conv(4, 2, 1), keywords

    def forward(self, x):
        return self.b(torch.relu(F.interpolate(self.a(x), **self.keywords)))


class DecoderWithKwargs(Decoder):
    """**kwargs keep torch.fx off: the dynamo path."""
    def forward(self, x, **unused):
        return super().forward(x)


def _call_functions(optimized):
    return [n.target for c in optimized.captured for n in c.forward.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dims, keywords", CASES, ids=[f"{d}d-{k['mode']}-{i}" for i, (d, k) in enumerate(CASES)])
@pytest.mark.parametrize("cls", [Decoder, DecoderWithKwargs], ids=["torch.fx", "dynamo"])
def test_an_upsampling_is_one_op_in_inference_and_bit_equal_to_eager(dims, keywords, cls):
    torch.manual_seed(0)
    model = cls(dims, keywords).eval()
    x = torch.randn(2, 3, *[6, 8, 5][:dims - 2])
    with torch.no_grad():
        expected = model(x)
    functions = {name: getattr(torch._C._nn, name) for name in dir(torch._C._nn) if "upsample" in name}
    optimized = fxdream.optimize(model, (x,), cost=None)
    assert all(getattr(torch._C._nn, n) is f for n, f in functions.items())  # the capture put torch's back
    assert optimized.report.fallback_reason is None
    targets = _call_functions(optimized)
    assert targets.count(upsample) == 1
    assert not any("_unsafe_index" in str(t) for t in targets)  # not decomposed
    actual = optimized(x)
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("dims, keywords", [c for c in CASES if c[0] in (4, 5)],
                         ids=[f"{d}d-{k['mode']}" for d, k in CASES if d in (4, 5)])
def test_the_ops_fake_output_has_the_kernels_strides(dims, keywords):
    # a pass reasons about layouts from the fake values: a channels_last input comes out
    # channels_last, as the kernels lay it out
    layout = torch.channels_last if dims == 4 else torch.channels_last_3d
    x = torch.randn(2, 3, *[6, 8, 5][:dims - 2]).contiguous(memory_format=layout)
    optimized = fxdream.optimize(_Interpolate(keywords), (x,), cost=None)
    node = next(n for n in optimized.captured[0].forward.graph.nodes if n.target is upsample)
    real = F.interpolate(x, **keywords)
    assert node.meta["val"].shape == real.shape and node.meta["val"].stride() == real.stride()
    assert torch.equal(optimized(x), real)


class _Interpolate(nn.Module):
    def __init__(self, keywords):
        super().__init__()
        self.keywords = keywords

    def forward(self, x):
        return F.interpolate(x, **self.keywords)


@pytest.mark.parametrize("cost", [None, "analytic"], ids=["prepacked-channels_last", "chosen"])
def test_nn_upsample_modules_and_fused_convs_around_them_equal_eager(cost):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                          nn.Upsample(scale_factor=2, mode="bilinear"), nn.Conv2d(8, 8, 3, padding=1),
                          nn.ReLU(), nn.UpsamplingNearest2d(scale_factor=2)).eval()
    x = torch.randn(1, 3, 8, 8)
    with torch.no_grad():
        expected = model(x)
    optimized = fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"], cost=cost)
    assert _call_functions(optimized).count(upsample) == 2
    assert next(r for r in optimized.report.passes if r.name == "fuse_conv_bias_act").applied
    torch.testing.assert_close(optimized(x), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dims, keywords", CASES, ids=[f"{d}d-{k['mode']}-{i}" for i, (d, k) in enumerate(CASES)])
def test_training_keeps_it_whole_with_eagers_backward_kernel_and_gradients(dims, keywords):
    # the decomposition's forward and backward had made a U-Net's training step 1.6x eager's
    torch.manual_seed(0)
    model, x = Decoder(dims, keywords), torch.randn(2, 3, *[6, 8, 5][:dims - 2], requires_grad=True)
    optimized = fxdream.optimize(model, (x,), training=True, cost=None)
    assert optimized.report.fallback_reason is None
    (captured,) = optimized.captured
    assert [n.target for n in captured.forward.graph.nodes].count(upsample) == 1
    backward = [str(n.target) for n in captured.backward.graph.nodes if n.op == "call_function"]
    assert any(t.endswith("_backward.default") and "upsample" in t for t in backward)
    assert not any("_unsafe_index" in t for t in backward)
    x.grad = None
    out = optimized(x)
    out.square().sum().backward()
    grads = [t.grad.clone() for t in (x, *model.parameters())]
    for t in (x, *model.parameters()):
        t.grad = None
    expected = model(x)
    expected.square().sum().backward()
    assert torch.equal(out, expected)
    for mine, eager in zip(grads, (t.grad for t in (x, *model.parameters()))):
        torch.testing.assert_close(mine, eager, rtol=1e-5, atol=1e-6)


def test_the_op_passes_opcheck():
    x = torch.randn(2, 3, 5, 7, requires_grad=True)
    for args in [(x, "upsample_bilinear2d", None, False, [2.0, 1.5]),
                 (x, "upsample_nearest2d", [9, 4], None, None),
                 (x.contiguous(memory_format=torch.channels_last), "upsample_bicubic2d", [6, 6], True, None)]:
        # not test_aot_dispatch_dynamic: the op is only used at static shapes (symbolic ones are
        # left to torch), and ATen's backward meta kernels reject symbolic sizes from scale factors
        torch.library.opcheck(upsample, args, test_utils=("test_schema", "test_autograd_registration",
                                                          "test_faketensor", "test_aot_dispatch_static"))


@pytest.mark.cuda
@pytest.mark.parametrize("training", [False, True])
def test_on_a_gpu_the_ops_equal_eager(training):
    from fxdream.ops.max_pool1d import max_pool1d_inference
    from fxdream.ops.pad import pad_inference
    torch.manual_seed(0)

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular")

        def forward(self, x):
            y = F.interpolate(self.conv(x), scale_factor=2, mode="bilinear")
            return y, F.max_pool1d(y.flatten(2), 3, 2)

    model, x = Mixed().cuda().train(training), torch.randn(2, 3, 8, 8, device="cuda")
    optimized = fxdream.optimize(model, (x,), training=training, cost=None)
    targets = _call_functions(optimized)
    assert upsample in targets
    assert (pad_inference in targets and max_pool1d_inference in targets) == (not training)
    with torch.set_grad_enabled(training):
        actual, expected = optimized(x), model(x)
    for a, e in zip(actual, expected):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    if training:
        sum(a.sum() for a in actual).backward()
        grad = model.conv.weight.grad.clone()
        model.zero_grad()
        sum(e.sum() for e in expected).backward()
        torch.testing.assert_close(grad, model.conv.weight.grad, rtol=1e-4, atol=1e-5)
