"""Regressions: bugs the fuzzer found (now fixed), shrunk by hand to the smallest net that showed them."""
from __future__ import annotations

from .nets import L, NetSpec
from .test_fuzz_optimize import EXACT, WITH_PASSES, check_inference, check_training, check_training_without_passes


def _conv(cin, cout, **kw):
    return L("conv", **{**dict(cin=cin, cout=cout, k=1, s=1, p=0, d=1, groups=1, bias=True), **kw})


def test_regression_channels_last_output_layout_restored():
    """A fused conv output the graph returns comes back NCHW, also through a view (flatten → Linear)."""
    spec = NetSpec("conv", 2, (3, 4, 4), (_conv(3, 5, k=3, p=1), L("act", fn="relu")), None, seed=0)
    check_inference(spec, ["fuse_conv_bias_act"], WITH_PASSES, cost=None)


def test_regression_prepacked_fake_output_layout():
    """The fake kernel of a prepacked fused conv gives the layout oneDNN really returns (1 input channel)."""
    spec = NetSpec("conv", 2, (1, 4, 4), (_conv(1, 5),), L("head", pool="flatten", out=5, bias=True), seed=0)
    check_inference(spec, ["fuse_conv_bias_act"], WITH_PASSES, cost=None)


def test_regression_reinplace_sees_through_unsafe_view():
    """aot's ``_unsafe_view`` shares its input's memory though its schema says otherwise: reinplace
    overwrote the saved output of the first block through one (wrong gradients), as found."""
    def block(fin, bias, post):
        inner = (L("linear", fin=fin, out=10, bias=True), L("act", fn="relu_inplace"),
                 L("linear", fin=10, out=10, bias=bias))
        proj = L("linear", fin=fin, out=10, bias=True) if fin != 10 else None
        return L("res", inner=inner, proj=proj, proj_bn=False, add="+=", shortcut_first=True, post=post)
    spec = NetSpec("mlp", 1, (4, 5), (block(5, False, "relu_inplace"), block(10, True, "relu_"),
                                      L("linear", fin=10, out=13, bias=True)),
                   L("head", pool="none", out=7, bias=False), seed=491)
    check_training(spec, ["reinplace"], EXACT, cost=None)


def test_regression_sdpa_output_layout():
    """Found by the slow fuzzer (2026-11-25): the fused attention's output, returned by the graph
    through a transpose and a reshape, came back (4, 2, 1)-strided where eager's is (4, 1, 2)."""
    inner = (L("linear", fin=3, out=2, bias=True), L("act", fn="relu6_inplace"))
    spec = NetSpec("mlp", 3, (2, 3), (
        L("res", inner=inner, proj=L("linear", fin=3, out=2, bias=False), proj_bn=False, add="+",
          shortcut_first=True, post="relu_"),
        L("attn", f=2, heads=2, scale="q", mask="causal_fill", output="plain", dropout=0.25, steps=2),
        L("act", fn="gelu"), L("dropout", p=0.0, variant="functional", inplace=True)), None, seed=3834)
    check_inference(spec, ["fuse_attention"], WITH_PASSES, cost=None)


def test_regression_training_without_passes_is_exact_against_aot_eager():
    """Found by the slow fuzzer (2026-11-26): an attention layer whose probabilities are used twice
    gets gradients 6e-8 off eager's, from aot_autograd's own backward (torch.compile with the
    aot_eager backend is off by as much): exact against that instead."""
    spec = NetSpec("mlp", 3, (3, 1), (
        L("linear", fin=1, out=7, bias=True), L("inplace", op="add_scalar", shape=(7,)),
        L("attn", f=7, heads=7, scale="mul", mask="mask_then_scale", output="with_probs", dropout=0.25, steps=3)),
        None, seed=5893)
    check_training_without_passes(spec, (), EXACT, None)  # (with torch 2.13; another torch may be exact)


def test_regression_training_steps_continue_from_the_same_weights():
    """Found by the slow fuzzer (2026-11-26): after one SGD step from gradients a rounding apart,
    an input on the edge of a saturated hardtanh fell on different sides in eager and fused, and
    a BN bias's next gradient was 0 against 1.2e-4. Both now continue from eager's weights."""
    def conv(cin, cout, k=1, p=0, d=1, groups=1, bias=False):
        return L("conv", cin=cin, cout=cout, k=k, s=1, p=p, d=d, groups=groups, bias=bias)

    def bn(c):
        return L("bn", c=c, dims=3, affine=True, momentum=0.1)
    spec = NetSpec("conv", 1, (4, 12, 16), (
        L("res", inner=(conv(4, 7, k=3, p=2, d=2), bn(7), bn(7)), proj=conv(4, 7), proj_bn=False, add="+=",
          shortcut_first=True, post="hardtanh"),
        L("res", inner=(conv(7, 7, groups=7, bias=True), bn(7), L("act", fn="relu_inplace"), conv(7, 7, groups=7)),
          proj=None, proj_bn=False, add="+=", shortcut_first=False, post="hardtanh"),
        L("shared", conv=conv(7, 7, k=3, p=2, d=2, bias=True), bn=False, act="silu"),
        L("fork", conv=conv(7, 10, bias=True), branch=(L("act", fn="hardtanh"),), combine="*"),
        bn(10), L("shared", conv=conv(10, 10, k=3, p=1), bn=False, act="relu")), None, seed=2)
    check_training(spec, ["fuse_conv_bias_act"], WITH_PASSES, cost="analytic")
