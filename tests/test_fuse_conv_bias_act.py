"""fuse_conv_bias_act: the fused ops are exact and trainable, the pass matches what it should,
skips what it must (and says why), and picks its variant by the predicted cost."""
import dataclasses

import pytest
import torch
from torch import nn

import fxdream
from fxdream import models
from fxdream.ops import fused_conv as ops
from fxdream.pass_api import PassContext
from fxdream.pass_registry import resolve_passes
from fxdream.passes.fuse_conv_bias_act import sites as conv_sites
from fxdream.passes import fuse_conv_bias_act as fuse

from conftest import assert_same_training_step

PASS = "fuse_conv_bias_act"
FUSED = set(ops.FUSED_OPS)
S, P, D = [1, 1], [1, 1], [1, 1]


def fused_targets(gm):
    return [n.target for n in gm.graph.nodes if n.op == "call_function" and n.target in FUSED]


def pass_context(model, captured, training=False, predict_us=None, forced=True):
    """The PassContext the pipeline builds: forward placeholders → the model's live tensors."""
    state = {t.data_ptr() for t in list(model.parameters()) + list(model.buffers())}
    names = [n.name for n in captured.forward.graph.nodes if n.op == "placeholder"]
    params = {name: t for name, t in zip(names, captured.example_inputs)
              if isinstance(t, torch.Tensor) and t.data_ptr() in state}
    return PassContext(device="cpu", training=training, phase="fw", params=params, predict_us=predict_us,
                       forced=forced)


def run_forward(gm, captured):
    with torch.no_grad():
        return gm(*captured.example_inputs)[0]


# --- through fxdream.optimize -------------------------------------------------------------------
INFERENCE = {"mnist_convnet": "3 conv+bias+relu", "resnet18": "4 conv+bn+add+relu",
             "resnet50": "4 conv+bn+add+relu", "vgg19": "16 conv+bias+relu"}


@pytest.mark.parametrize("name", sorted(INFERENCE))
def test_inference_equals_eager_and_graph_holds_fused_ops(name):
    model, inputs, _ = models.build(name, 2, tiny=True)
    model.eval()
    optimized = fxdream.optimize(model, inputs, passes=[PASS], cost=None)  # no cost model: default variant
    (row,) = optimized.report.passes
    assert row.applied, row.reason
    assert INFERENCE[name] in row.reason and "channels_last+prepacked" in row.reason
    assert "no cost model" in row.reason
    assert fused_targets(optimized.rewritten_graphs[(0, "fw")])
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs), model(*inputs), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name,fused", [("mnist_convnet", 3), ("vgg19", 16), ("resnet18", 0), ("resnet50", 0)])
def test_training_step_equals_eager(name, fused):
    model, inputs, loss_fn = models.build(name, 2, tiny=True)
    optimized = fxdream.optimize(model, inputs, passes=[PASS], training=True, cost=None)
    assert assert_same_training_step(model, optimized, inputs, loss_fn, atol=1e-4, rtol=1e-4) > 0
    rows = {r.phase: r for r in optimized.report.passes}
    assert rows["bw"].reason == "rewrites forward graphs; the backward is unchanged"
    targets = fused_targets(optimized.rewritten_graphs[(0, "fw")])
    assert len(targets) == fused and set(targets) <= {torch.ops.fxdream.conv_bias_relu.default}
    if not fused:  # ResNets train with batch norm between conv and relu: nothing to fuse, said so
        assert not rows["fw"].applied and "no conv+bias+relu" in rows["fw"].reason
        assert "followed by batch norm in training" in rows["fw"].reason


class ConvAddRelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.conv1(x))
        return torch.relu(self.conv2(y) + y)


@pytest.mark.parametrize("training", [False, True])
def test_conv_add_relu_without_batch_norm(training):
    torch.manual_seed(0)
    model, inputs = ConvAddRelu(), (torch.randn(2, 3, 12, 12),)
    optimized = fxdream.optimize(model, inputs, passes=[PASS], training=training, cost=None)
    row = optimized.report.passes[0]
    assert row.applied and "1 conv+bias+relu, 1 conv+bias+add+relu" in row.reason, row.reason
    if training:
        assert set(fused_targets(optimized.rewritten_graphs[(0, "fw")])) == set(ops.FUSED_OPS[:2])
        assert_same_training_step(model, optimized, inputs, atol=1e-5)
    else:
        with torch.no_grad():
            out = optimized(*inputs)  # channels_last inside, NCHW again at the output
            torch.testing.assert_close(out, model.eval()(*inputs), atol=1e-5, rtol=1e-5)
        assert out.is_contiguous() and "channels_last+prepacked" in row.reason
        # conv2 reads y, so the sum cannot be accumulated into y in place: the wrapper stays
        targets = fused_targets(optimized.rewritten_graphs[(0, "fw")])
        assert targets == [ops.ONEDNN_CONV, ops.conv_fused_inference_prepacked]


class ResidualKept(nn.Module):
    """relu(conv(x) + r), and r read after the add through a view taken before it."""

    def __init__(self):
        super().__init__()
        self.conv0, self.conv = nn.Conv2d(3, 8, 1), nn.Conv2d(3, 8, 3, padding=1)

    def forward(self, x):
        r = self.conv0(x) * 2  # computed in the graph, not an input
        part = r[:, :4]  # channels_last already (so no layout copy before the view): aliases r
        return torch.relu(self.conv(x) + r), part * 3


def test_residual_is_accumulated_in_place_only_when_nobody_reads_it_later():
    torch.manual_seed(0)
    inputs = (torch.randn(2, 3, 8, 8).contiguous(memory_format=torch.channels_last),)
    model, resnet = ResidualKept().eval(), models.build("resnet18", 2, tiny=True)[0].eval()
    kept = fxdream.optimize(model, inputs, passes=[PASS], cost=None)
    assert ops.ONEDNN_CONV_ADD_ not in fused_targets(kept.rewritten_graphs[(0, "fw")])
    with torch.no_grad():
        for got, want in zip(kept(*inputs), model(*inputs)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    x = torch.randn(2, 3, 32, 32)
    fused = fxdream.optimize(resnet, (x,), passes=[PASS], cost=None)
    targets = fused_targets(fused.rewritten_graphs[(0, "fw")])
    sums = int(fused.report.passes[0].reason.split(" conv+bn+add+relu")[0].rsplit(" ", 1)[-1])
    assert targets.count(ops.ONEDNN_CONV_ADD_) == sums > 0  # every block's conv+bn+add+relu
    with torch.no_grad():
        torch.testing.assert_close(fused(x), resnet(x), atol=1e-4, rtol=1e-4)


def test_prepacked_output_layout_when_the_weight_layout_is_ambiguous():
    """A (5, 1, 1, 1) weight is NCHW and channels_last at once; packed, oneDNN still returns
    channels_last, so the flatten before the Linear needs the layout given back."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 5, 1), nn.Flatten(), nn.Linear(80, 5)).eval()
    x = torch.randn(2, 1, 4, 4)
    optimized = fxdream.optimize(model, (x,), passes=[PASS], cost=None)
    assert optimized.report.fallback_reason is None and optimized.report.passes[0].applied
    assert fused_targets(optimized.rewritten_graphs[(0, "fw")]) == [ops.ONEDNN_CONV]  # oneDNN, directly
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), atol=1e-5, rtol=1e-5)


# --- calling the pass directly --------------------------------------------------------------
@pytest.mark.parametrize("name", ["resnet18", "vgg19"])
def test_every_variant_is_correct(name):
    """NCHW, channels_last (converted back before the classifier's view) and prepacked."""
    model, inputs, _ = models.build(name, 2, tiny=True)
    model.eval()
    captured = fxdream.capture(model, inputs)
    ctx = pass_context(model, captured)
    with torch.no_grad():
        expected = model(*inputs)
    for variant in (fuse.NCHW_FUSED, fuse.CHANNELS_LAST, fuse.PREPACKED):
        gm = fuse.FuseConvBiasAct._build(captured.forward, ctx, variant)
        assert fused_targets(gm), variant
        out = run_forward(gm, captured)
        assert out.is_contiguous()
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4, msg=lambda m: f"{variant.name}: {m}")
        attrs = [getattr(gm, n.target) for n in gm.graph.nodes if n.op == "get_attr"]
        assert any(t.is_mkldnn for t in attrs) == variant.prepack
        for node in gm.graph.nodes:
            if node.op == "call_function":
                assert "val" in node.meta and "layer" in node.meta, node.name


def test_batch_norm_folding_math():
    torch.manual_seed(0)
    conv, bn = nn.Conv2d(3, 6, 3, padding=1), nn.BatchNorm2d(6)
    with torch.no_grad():
        bn.running_mean.normal_()
        bn.running_var.uniform_(0.5, 2.0)
        bn.weight.normal_()
        bn.bias.normal_()
    model = nn.Sequential(conv, bn).eval()
    x = torch.randn(2, 3, 9, 9)
    w, b = fuse.fold_batch_norm(conv.weight, conv.bias, bn.weight, bn.bias, bn.running_mean, bn.running_var, bn.eps)
    scale = bn.weight / torch.sqrt(bn.running_var + bn.eps)
    torch.testing.assert_close(w, conv.weight * scale[:, None, None, None])
    torch.testing.assert_close(b, bn.bias + (conv.bias - bn.running_mean) * scale)
    with torch.no_grad():
        torch.testing.assert_close(nn.functional.conv2d(x, w, b, padding=1), model(x), atol=1e-5, rtol=1e-5)
    captured = fxdream.capture(model, (x,))
    result = resolve_passes([PASS])[0](captured.forward, pass_context(model, captured))
    assert result.modified and result.reason.startswith("fused 1 conv+bias+bn;"), result.reason
    assert not any(n.target is conv_sites.BN for n in result.graph_module.graph.nodes if n.op == "call_function")
    with torch.no_grad():
        torch.testing.assert_close(run_forward(result.graph_module, captured), model(x), atol=1e-5, rtol=1e-5)


def test_no_pattern_is_not_modified():
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU()).eval(), torch.randn(2, 4)
    captured = fxdream.capture(model, (x,))
    result = resolve_passes([PASS])[0](captured.forward, pass_context(model, captured))
    assert not result.modified and result.reason == "no conv+bias+relu, conv+add+relu or conv+bn pattern to fuse"


def test_transposed_and_float64_convolutions_are_left_alone_and_the_reason_says_so():
    model = nn.Sequential(nn.ConvTranspose1d(4, 4, 3, padding=1), nn.ReLU(), nn.Conv1d(4, 4, 1), nn.ReLU()).double()
    x = torch.randn(2, 4, 10, dtype=torch.double)
    optimized = fxdream.optimize(model.eval(), (x,), passes=[PASS], cost=None)
    (row,) = optimized.report.passes
    assert not row.applied and row.reason.endswith("(1 convolution(s): transposed convolution; "
                                                   "1 convolution(s): cpu torch.float64: no fused kernel)"), row.reason
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))


class SharedConvOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        y = self.conv(x)
        return torch.relu(y), y * 2


class BiasWrittenOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.bias = nn.Parameter(torch.randn(4))

    def forward(self, x):
        return torch.relu(self.conv(x) + self.bias.view(1, -1, 1, 1))


def test_an_add_whose_other_addend_broadcasts_is_not_fused_and_the_note_says_why():
    model, x = BiasWrittenOut().eval(), torch.randn(1, 3, 8, 8)
    captured = fxdream.capture(model, (x,), training=False)
    result = resolve_passes([PASS])[0](captured.forward, pass_context(model, captured, False))
    assert "conv: add+relu not fused: the other addend is not a tensor of the convolution's shape and dtype " \
           "(float32 (1, 4, 1, 1))" in result.notes, result.notes
    assert not any("also used by" in n for n in result.notes)


@pytest.mark.parametrize("training", [False, True])
def test_site_with_another_user_is_skipped_with_a_note(training):
    model, x = SharedConvOutput(), torch.randn(1, 3, 8, 8, requires_grad=training)
    model.train(training)
    captured = fxdream.capture(model, (x,), training=training)
    result = resolve_passes([PASS])[0](captured.forward, pass_context(model, captured, training))
    assert any(n.startswith("conv: relu not fused: convolution is also used by") for n in result.notes), result.notes
    assert any(n.target is conv_sites.RELU for n in result.graph_module.graph.nodes if n.op == "call_function")
    if training:  # nothing else to gain: left alone
        assert not result.modified
    else:  # the conv alone still becomes oneDNN's (prepacked) conv; the relu stays
        assert result.modified and "1 conv+bias;" in result.reason


def _by_structure(times):
    """A stand-in cost model that recognizes each variant by what its graph holds."""
    def predict_us(gm):
        nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "get_attr")]
        if not any(n.target in FUSED for n in nodes):
            return times["unfused"]
        if any(n.op == "get_attr" and getattr(gm, n.target).is_mkldnn for n in nodes):
            return times["channels_last+prepacked"]
        if any(n.target is fuse.CLONE and n.kwargs.get("memory_format") == torch.channels_last for n in nodes):
            return times["channels_last"]
        return times["nchw"]
    return predict_us


def test_variant_is_chosen_by_predicted_time():
    model, inputs, _ = models.build("resnet18", 1, tiny=True)
    model.eval()
    captured = fxdream.capture(model, inputs)
    the_pass = resolve_passes([PASS])[0]
    times = {"unfused": 4000.0, "nchw": 3000.0, "channels_last+prepacked": 3200.0}
    result = the_pass(captured.forward, pass_context(model, captured, predict_us=_by_structure(times)))
    assert result.modified and result.reason.endswith("; nchw (predicted 1.33x)"), result.reason
    assert result.notes[0] == "predicted: unfused 4.000 ms, channels_last+prepacked 3.200 ms, nchw 3.000 ms → nchw"
    slower = {**times, "unfused": 2000.0}  # under "auto" (not forced) it declines; named, it applies
    result = the_pass(captured.forward, pass_context(model, captured, predict_us=_by_structure(slower), forced=False))
    assert not result.modified
    assert result.reason.startswith("every fused variant is predicted slower than unfused")
    result = the_pass(captured.forward, pass_context(model, captured, predict_us=_by_structure(slower)))
    assert result.modified and result.reason.endswith("; nchw (forced: predicted 0.67x)"), result.reason
    assert result.notes[0].endswith("→ nchw (forced)")


class _PerOpCost:
    """A stand-in cost model: every op removed by fusion (BN, add, relu) costs ``removed_us``."""
    def __init__(self, removed_us):
        self.removed_us = removed_us

    def kernel_us(self, node):
        return self.removed_us

    def dispatch_us(self, node):
        return 0.0


@pytest.mark.parametrize("removed_us, built", [(10.0, False), (200.0, True)])
def test_nchw_is_not_built_when_its_floor_loses(removed_us, built):
    # NCHW's floor: unfused minus the ops fusion removes (BN + its getitem, add, relu); over 1.1x
    # the prepacked variant timed before it, NCHW is neither built nor timed
    model, inputs, _ = models.build("resnet18", 1, tiny=True)
    model.eval()
    captured = fxdream.capture(model, inputs)
    removed = len([n for n in captured.forward.graph.nodes if n.op == "call_function" and any(
        k in str(n.target) for k in ("batch_norm", "getitem", "relu", "add"))])
    assert 4 <= removed < 60  # so 4000 - removed x 10 > 3300 > 4000 - removed x 200
    times = {"unfused": 4000.0, "nchw": 3900.0, "channels_last+prepacked": 3000.0}
    ctx = dataclasses.replace(pass_context(model, captured, predict_us=_by_structure(times)),
                              cost_model=_PerOpCost(removed_us))
    result = resolve_passes([PASS])[0](captured.forward, ctx)
    assert result.modified and result.reason.endswith("; channels_last+prepacked (predicted 1.33x)")
    floor_note = [n for n in result.notes if n.startswith("variant nchw not built: at least ")]
    if built:
        assert not floor_note and " nchw 3.900 ms" in result.notes[0]
    else:
        assert " nchw " not in result.notes[0]
        assert floor_note and floor_note[0].endswith("x channels_last+prepacked"), floor_note


def test_measured_cost_model_times_every_variant():
    model, inputs, _ = models.build("mnist_convnet", 2, tiny=True)
    model.eval()
    optimized = fxdream.optimize(model, inputs, passes=[PASS])  # Profiled: measured on this machine
    (row,) = optimized.report.passes
    predicted = next(n for n in row.notes if n.startswith("predicted:"))
    for name in ("unfused", "channels_last+prepacked"):
        assert f" {name} " in predicted
    # nchw is timed, or left out by its floor, and the notes say which
    assert " nchw " in predicted or any(n.startswith("variant nchw not built: at least ") for n in row.notes)
    assert " channels_last " not in predicted  # dominated by prepacked on a CPU: not timed
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs), model(*inputs), atol=1e-4, rtol=1e-4)


def test_applies_to_forward_graphs_only():
    the_pass = resolve_passes([PASS])[0]
    assert the_pass.applies_to(PassContext(phase="fw")) is None
    assert the_pass.applies_to(PassContext(phase="bw", training=True)) == \
        "rewrites forward graphs; the backward is unchanged"


# --- CUDA (cuDNN fused calls) ---------------------------------------------------------------

@pytest.mark.cuda
def test_cuda_ops_match_aten(no_tf32):
    torch.manual_seed(0)
    x = torch.randn(2, 16, 14, 14, device="cuda", requires_grad=True)
    w = torch.randn(32, 16, 3, 3, device="cuda", requires_grad=True)
    b = torch.randn(32, device="cuda", requires_grad=True)
    other = torch.randn(2, 32, 14, 14, device="cuda", requires_grad=True)
    conv = lambda: torch.nn.functional.conv2d(x, w, b, 1, 1)  # noqa: E731
    cases = [(ops.conv_bias_relu(x, w, b, S, P, D, 1), torch.relu(conv()), (x, w, b)),
             (ops.conv_bias_add_relu(x, w, b, other, S, P, D, 1), torch.relu(conv() + other), (x, w, b, other))]
    for fused_out, ref_out, inputs in cases:
        torch.testing.assert_close(fused_out, ref_out, atol=1e-4, rtol=1e-4)
        grad = torch.randn_like(ref_out)
        grads = zip(torch.autograd.grad(fused_out, inputs, grad), torch.autograd.grad(ref_out, inputs, grad))
        for g_fused, g_ref in grads:
            torch.testing.assert_close(g_fused, g_ref, atol=1e-3, rtol=1e-4)
    with torch.no_grad():
        out = ops.conv_fused_inference(x.half(), w.half(), b.half(), other.half(), S, P, D, 1, "relu")
        torch.testing.assert_close(out.float(), torch.relu(conv() + other), atol=5e-2, rtol=1e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("name,training", [("resnet18", False), ("vgg19", False), ("vgg19", True)])
def test_cuda_models_equal_eager(name, training, no_tf32):
    model, inputs, loss_fn = models.build(name, 2, tiny=True, device="cuda")
    model.train(training)
    optimized = fxdream.optimize(model, inputs, passes=[PASS], training=training, cost=None)
    row = optimized.report.passes[0]
    assert row.applied, row.reason
    assert fused_targets(optimized.rewritten_graphs[(0, "fw")])
    if training:
        assert_same_training_step(model, optimized, inputs, loss_fn, atol=1e-3, rtol=1e-3)
    else:
        with torch.no_grad():
            torch.testing.assert_close(optimized(*inputs), model(*inputs), atol=1e-3, rtol=1e-3)


class MobileBlock(nn.Module):
    """MobileNetV3 / EfficientNet style: conv → BN → hardswish / SiLU, depthwise, then a 1x1."""
    def __init__(self, act):
        super().__init__()
        self.act = act
        self.pw = nn.Conv2d(8, 16, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.out = nn.Conv2d(16, 8, 1)

    def forward(self, x):
        y = self.act(self.bn1(self.pw(x)))
        y = self.act(self.bn2(self.dw(y)))
        return torch.sigmoid(self.out(y))


@pytest.mark.parametrize("act,aten,onednn", [(nn.SiLU(), "silu", "swish"), (nn.Hardswish(), "hardswish", "hardswish"),
                                             (nn.ReLU6(inplace=True), "hardtanh", "hardtanh")])
def test_cpu_inference_fuses_silu_hardswish_and_sigmoid_and_equals_eager(act, aten, onednn):
    torch.manual_seed(0)
    model, x = MobileBlock(act).eval(), torch.randn(2, 8, 12, 12)
    for m in (model.bn1, model.bn2):  # non-trivial statistics
        m.running_mean.uniform_(-0.5, 0.5)
        m.running_var.uniform_(0.5, 2.0)
    optimized = fxdream.optimize(model, (x,), passes=[PASS], cost=None)
    (row,) = optimized.report.passes
    assert row.applied and row.reason.startswith(f"fused 2 conv+bn+{aten}, 1 conv+bias+sigmoid"), row.reason
    graph = optimized.rewritten_graphs[(0, "fw")]
    acts = []  # (oneDNN post-op, its scalars) of each fused conv, prepacked and called directly or not
    for n in graph.graph.nodes:
        if n.target is ops.ONEDNN_CONV:
            acts.append((n.args[7], list(n.args[8])))
        elif n.target in ops.INFERENCE_OPS:
            acts.append(ops.onednn_unary(n.args[8]))
    bounds = [0.0, 6.0] if onednn == "hardtanh" else []  # ReLU6's bounds travel with it
    assert sorted(acts) == sorted([(onednn, bounds), (onednn, bounds), ("sigmoid", [])])
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), rtol=1e-4, atol=1e-5)


def test_training_fuses_relu_only():
    torch.manual_seed(0)
    model, x = MobileBlock(nn.SiLU()).train(), torch.randn(2, 8, 12, 12)
    optimized = fxdream.optimize(model, (x,), passes=[PASS], training=True, cost=None)
    assert not any(r.applied for r in optimized.report.passes)
    forward = next(r for r in optimized.report.passes if r.phase == "fw")
    assert ("2 convolution(s): followed by batch norm in training, whose batch statistics leave nothing "
            "to fold; 1 convolution(s): not followed by relu or add+relu") in forward.reason
    assert_same_training_step(model, optimized, (x,))


class NoisyConvNet(nn.Module):
    """Noise injection and a dropout left in train mode after convolutions the pass converts to
    channels_last: which random number lands in which element follows the memory order."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 8, 3, padding=1), nn.Conv2d(8, 4, 3, padding=1)
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        y = y + 0.5 * torch.randn_like(y)
        return self.drop(torch.relu(self.c2(y)))


def test_random_numbers_are_drawn_in_eager_order_in_a_channels_last_variant():
    torch.manual_seed(0)
    model = NoisyConvNet().eval()
    model.drop.train()
    x = torch.randn(2, 3, 10, 10)
    optimized = fxdream.optimize(model, (x,), passes=[PASS], cost=None)  # CPU default: channels_last
    assert optimized.report.passes[0].applied
    with torch.no_grad():
        torch.manual_seed(1)
        expected = model(x)
        torch.manual_seed(1)
        torch.testing.assert_close(optimized(x), expected, atol=1e-5, rtol=1e-5)
