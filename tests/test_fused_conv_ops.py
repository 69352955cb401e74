"""The fused conv ops themselves: exact against aten (forward and gradients), 1-d to 3-d,
registered correctly (torch.library.opcheck), counted as convolutions by the flop counter."""
import pytest
import torch

from fxdream.ops import fused_conv as ops

S, P, D = [1, 1], [1, 1], [1, 1]


@pytest.mark.parametrize("stride,padding,dilation,groups", [([1, 1], [1, 1], [1, 1], 1), ([2, 1], [0, 1], [1, 2], 2)])
def test_ops_gradcheck_float64(stride, padding, dilation, groups):
    torch.manual_seed(0)
    x = torch.randn(1, 4, 5, 6, dtype=torch.double, requires_grad=True)
    w = torch.randn(4, 4 // groups, 3, 3, dtype=torch.double, requires_grad=True)
    b = torch.randn(4, dtype=torch.double, requires_grad=True)
    out_shape = ops.conv_output_shape(x.shape, w.shape, stride, padding, dilation)
    other = torch.randn(out_shape, dtype=torch.double, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w, b: ops.conv_bias_relu(x, w, b, stride, padding, dilation, groups),
                                    (x, w, b), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x, w: ops.conv_bias_relu(x, w, None, stride, padding, dilation, groups),
                                    (x, w), fast_mode=True)
    assert torch.autograd.gradcheck(
        lambda x, w, b, o: ops.conv_bias_add_relu(x, w, b, o, stride, padding, dilation, groups), (x, w, b, other),
        fast_mode=True)


def test_ops_float32_match_aten_forward_and_grads():
    """float32 runs oneDNN's fused kernel (float64 above falls back to aten): compare with aten."""
    torch.manual_seed(0)
    x = torch.randn(2, 16, 14, 14, requires_grad=True)
    w = torch.randn(32, 16, 3, 3, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    other = torch.randn(2, 32, 14, 14, requires_grad=True)
    conv = lambda: torch.nn.functional.conv2d(x, w, b, 1, 1)  # noqa: E731
    cases = [(ops.conv_bias_relu(x, w, b, S, P, D, 1), torch.relu(conv()), (x, w, b)),
             (ops.conv_bias_add_relu(x, w, b, other, S, P, D, 1), torch.relu(conv() + other), (x, w, b, other))]
    for fused_out, ref_out, inputs in cases:
        torch.testing.assert_close(fused_out, ref_out, atol=1e-5, rtol=0)
        grad = torch.randn_like(ref_out)
        grads = zip(torch.autograd.grad(fused_out, inputs, grad), torch.autograd.grad(ref_out, inputs, grad))
        for g_fused, g_ref in grads:
            torch.testing.assert_close(g_fused, g_ref, atol=1e-4, rtol=1e-5)


def test_inference_op_with_prepacked_weight():
    torch.manual_seed(0)
    x, w, b = torch.randn(2, 8, 10, 10), torch.randn(16, 8, 3, 3), torch.randn(16)
    other = torch.randn(2, 16, 5, 5)
    packed = ops.prepack_conv_weight(w, [2, 2], P, D, 1, x.shape)
    out = ops.conv_fused_inference_prepacked(x, packed, b, other, [2, 2], P, D, 1, "relu")
    torch.testing.assert_close(out, torch.relu(torch.nn.functional.conv2d(x, w, b, 2, 1) + other), atol=1e-4, rtol=1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last)  # what the fake impl says too


def test_fused_ops_count_the_convolutions_flops():
    from torch.utils.flop_counter import FlopCounterMode
    x, w, b, other = torch.randn(2, 8, 10, 10), torch.randn(16, 8, 3, 3), torch.randn(16), torch.randn(2, 16, 10, 10)
    counts = []
    for run in (lambda: torch.nn.functional.conv2d(x, w, b, 1, 1),
                lambda: ops.conv_fused_inference(x, w, b, None, S, P, D, 1, "relu"),
                lambda: ops.conv_bias_add_relu(x, w, b, other, S, P, D, 1)):
        with FlopCounterMode(display=False) as counter:
            run()
        counts.append(counter.get_total_flops())
    assert counts == [2 * 2 * 16 * 10 * 10 * 8 * 9] * 3  # the analytic cost model reads these


@pytest.mark.parametrize("act", ["gelu", "hardtanh", "hardtanh:0.0", "relu:1.0"])
def test_an_unknown_or_malformed_post_op_is_refused(act):
    x, w = torch.randn(1, 2, 4, 4), torch.randn(2, 2, 3, 3)
    with pytest.raises(ValueError, match="act must be 'none', one of"):
        ops.conv_fused_inference(x, w, None, None, S, P, D, 1, act)


def _conv_args(nd: int, requires_grad: bool):
    """(x, w, b, other, stride, padding, dilation, groups) of a grouped, strided, dilated conv."""
    torch.manual_seed(nd)
    stride, padding, dilation = [2] + [1] * (nd - 1), [1] * nd, [1] * (nd - 1) + [2]
    x = torch.randn(2, 4, *[7] * nd, requires_grad=requires_grad)
    w = torch.randn(6, 2, *[3] * nd, requires_grad=requires_grad)
    b = torch.randn(6, requires_grad=requires_grad)
    other = torch.randn(ops.conv_output_shape(x.shape, w.shape, stride, padding, dilation),
                        requires_grad=requires_grad)
    return x, w, b, other, stride, padding, dilation, 2


@pytest.mark.parametrize("nd", [1, 2, 3])
def test_custom_ops_pass_opcheck(nd):
    """Schema, fake (meta) kernel, autograd registration and aot_autograd dispatch, as
    torch.library.opcheck tests them; the inference op (a Library op) as well."""
    x, w, b, other, stride, padding, dilation, groups = _conv_args(nd, requires_grad=True)
    cases = [(torch.ops.fxdream.conv_bias_relu.default, (x, w, b, stride, padding, dilation, groups)),
             (torch.ops.fxdream.conv_bias_relu.default, (x, w, None, stride, padding, dilation, groups)),
             (torch.ops.fxdream.conv_bias_add_relu.default, (x, w, b, other, stride, padding, dilation, groups))]
    frozen = [t.detach() for t in (x, w, b, other)]
    cases += [(ops.conv_fused_inference, (*frozen, stride, padding, dilation, groups, act))
              for act in ("relu", "swish", "none")]
    for op, args in cases:
        torch.library.opcheck(op, args)  # raises OpCheckError naming the failed check


@pytest.mark.parametrize("nd", [1, 3])
def test_1d_and_3d_fused_ops_match_aten_forward_and_grads(nd):
    """oneDNN's fused conv is 1-d to 3-d; its residual add is 2-d and 3-d, so a 1-d conv with a
    residual runs as a 2-d conv of height 1: exact all the same."""
    x, w, b, other, stride, padding, dilation, groups = _conv_args(nd, requires_grad=True)
    conv = getattr(torch.nn.functional, f"conv{nd}d")
    ref = lambda: conv(x, w, b, stride, padding, dilation, groups)  # noqa: E731
    cases = [(ops.conv_bias_relu(x, w, b, stride, padding, dilation, groups), torch.relu(ref()), (x, w, b)),
             (ops.conv_bias_add_relu(x, w, b, other, stride, padding, dilation, groups), torch.relu(ref() + other),
              (x, w, b, other))]
    for fused_out, ref_out, inputs in cases:
        torch.testing.assert_close(fused_out, ref_out, atol=1e-5, rtol=0)
        grad = torch.randn_like(ref_out)
        for g_fused, g_ref in zip(torch.autograd.grad(fused_out, inputs, grad), torch.autograd.grad(ref_out, inputs, grad)):
            torch.testing.assert_close(g_fused, g_ref, atol=1e-4, rtol=1e-5)
    with torch.no_grad():
        out = ops.conv_fused_inference(x, w, b, other, stride, padding, dilation, groups, "hardtanh:0.0,6.0")
        torch.testing.assert_close(out, torch.clamp(ref() + other, 0, 6), atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", ["ncl", "nlc"])
def test_1d_conv_runs_as_2d_over_height_1_with_the_layout_its_fake_says(layout):
    """An NLC input (a 1-d conv's output in a prepacked graph) gives an NLC output, and so does
    a prepacked weight; the fake impl says the same strides (what the graph is planned with)."""
    x, w, b, other, stride, padding, dilation, groups = _conv_args(1, requires_grad=False)
    if layout == "nlc":
        x, other = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (x, other))
    expected = torch.relu(torch.nn.functional.conv1d(x, w, b, stride, padding, dilation, groups) + other)
    packed = ops.prepack_conv_weight(w, stride, padding, dilation, groups, x.shape)
    for op, weight in ((ops.conv_fused_inference, w), (ops.conv_fused_inference_prepacked, packed)):
        out = op(x, weight, b, other, stride, padding, dilation, groups, "relu")
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
        assert ops.is_channels_last(out) == (layout == "nlc" or weight is packed)
        with torch._subclasses.fake_tensor.FakeTensorMode() as mode:
            fake = op(*(mode.from_tensor(t) for t in (x, w, b, other)), stride, padding, dilation, groups, "relu")
        assert fake.shape == out.shape and fake.stride() == out.stride()


def test_3d_conv_with_a_prepacked_weight_gives_channels_last_3d_as_its_fake_says():
    x, w, b, other, stride, padding, dilation, groups = _conv_args(3, requires_grad=False)
    packed = ops.prepack_conv_weight(w, stride, padding, dilation, groups, x.shape)
    out = ops.conv_fused_inference_prepacked(x, packed, b, other, stride, padding, dilation, groups, "relu")
    expected = torch.relu(torch.nn.functional.conv3d(x, w, b, stride, padding, dilation, groups) + other)
    torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-5)
    assert out.is_contiguous(memory_format=torch.channels_last_3d)
    with torch._subclasses.fake_tensor.FakeTensorMode() as mode:  # the graph's stand-in: the plain weight
        fake = ops.conv_fused_inference_prepacked(*(mode.from_tensor(t) for t in (x, w, b, other)), stride,
                                                  padding, dilation, groups, "relu")
    assert fake.shape == out.shape and fake.stride() == out.stride()
