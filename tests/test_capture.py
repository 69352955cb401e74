import functools
import logging

import pytest
import torch
import torch.nn as nn
from torch.fx.experimental.proxy_tensor import make_fx

import fxdream
from fxdream.ir.flops import node_flops
from fxdream.ir.nodes import LAYER, is_compute, op_name
from fxdream.capturing.layers import qualified_name


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(Block())
        self.fc = nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(self.body(x).flatten(1))


def _compute_nodes(gm):
    return [n for n in gm.graph.nodes if is_compute(n)]


def test_qualified_names_from_dynamo_paths():
    assert qualified_name("L['self'].layer1._modules['0'].conv1") == "layer1.0.conv1"
    assert qualified_name("L['self'].features[3]") == "features.3"
    assert qualified_name("L['fn'].seq.2.0") == "seq.2.0"
    assert qualified_name("L['self']") == ""
    # a forward wrapped by a ``*args`` decorator: dynamo's frame is the wrapper, ``self`` its args[0]
    assert qualified_name("L['args'][0].model.layers[0].self_attn") == "model.layers.0.self_attn"


def _passes_args_through(forward):
    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)
    return wrapper


class DecoratedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 2)

    @_passes_args_through
    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def test_a_forward_wrapped_by_an_args_decorator_names_its_layers_as_the_model_does():
    captured = fxdream.capture(DecoratedForward(), (torch.randn(2, 8),), training=True)
    layers = {n.meta[LAYER] for n in _compute_nodes(captured.forward)}
    assert layers == {"fc1", "fc2", ""}  # the relu is the model's own


def test_inference_capture_has_forward_only_with_layers():
    captured = fxdream.capture(Net(), (torch.randn(2, 3, 8, 8),))
    assert isinstance(captured, fxdream.Captured)
    assert captured.backward is None
    layers = {n.meta[LAYER] for n in _compute_nodes(captured.forward)}
    assert {"body.0.conv", "body.0.bn", "fc"} <= layers
    conv = next(n for n in captured.forward.graph.nodes if op_name(n) == "aten.convolution")
    assert conv.meta[LAYER] == "body.0.conv"
    assert tuple(conv.meta["val"].shape) == (2, 4, 6, 6)


def test_training_capture_maps_backward_nodes_to_forward_layers():
    captured = fxdream.capture(Net(), (torch.randn(2, 3, 8, 8),), training=True)
    assert captured.backward is not None
    by_op = {}
    for node in _compute_nodes(captured.backward):
        by_op.setdefault(op_name(node), set()).add(node.meta[LAYER])
    assert by_op["aten.convolution_backward"] == {"body.0.conv"}
    assert by_op["aten.native_batch_norm_backward"] == {"body.0.bn"}
    assert by_op["aten.mm"] == {"fc"}
    # torch.relu is called inside Block.forward: its gradient belongs to that block
    assert by_op["aten.threshold_backward"] == {"body.0"}
    assert captured.unmapped_backward_nodes == 0


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        self.skip = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)
        self.stem = nn.Linear(4, 4)

    def forward(self, x):
        h = self.stem(x)  # used twice: autograd sums its two gradients
        return self.head(self.block(h) + self.skip(h))


def test_gradient_accumulation_of_a_fan_out_belongs_to_the_module_of_both_users():
    captured = fxdream.capture(Residual(), (torch.randn(3, 4),), training=True)
    sums = [n for n in captured.backward.graph.nodes
            if n.op == "call_function" and n.target is torch.ops.aten.add.Tensor
            and not n.meta.get("fwd_nn_module_stack")]
    assert sums, "expected autograd's accumulation of the two gradients of h"
    # block.0 and skip meet only in the model itself (""), never in the head (whose seq_nr it carries)
    assert {n.meta[LAYER] for n in sums} == {""}


def test_every_conv_linear_matmul_node_has_a_layer():
    captured = fxdream.capture(Net(), (torch.randn(2, 3, 8, 8),), training=True)
    heavy = ("aten.convolution", "aten.convolution_backward", "aten.addmm", "aten.mm", "aten.bmm")
    for _, gm in captured.graphs():
        for node in gm.graph.nodes:
            if op_name(node) in heavy:
                assert node.meta[LAYER], node.format_node()


def test_summary_counts_flops_of_the_linear_layer():
    captured = fxdream.capture(Net(), (torch.randn(2, 3, 8, 8),), training=True)
    fc = next(s for s in captured.layers() if s.layer == "fc")
    # forward addmm: 2 * batch * in * out = 2 * 2 * 144 * 5
    assert fc.forward_flops == 2 * 2 * 144 * 5
    # backward: grad input (2*2*5*144) + grad weight (2*5*2*144) matmuls
    assert fc.backward_flops == 2 * (2 * 2 * 144 * 5)
    conv = next(s for s in captured.layers() if s.layer == "body.0.conv")
    # conv forward: 2 * N * Cout * Hout * Wout * Cin * k * k
    assert conv.forward_flops == 2 * 2 * 4 * 6 * 6 * 3 * 3 * 3
    text = captured.summary()
    assert "body.0.conv" in text and "fc" in text and "GFLOP" in text


def test_capture_leaves_the_model_untouched():
    model = Net()
    model.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 8, 8)
    rng = torch.get_rng_state()
    fxdream.capture(model, (x,), training=True)
    assert not model.training
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k
    assert torch.equal(torch.get_rng_state(), rng)


class Printing(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        print("between the layers")  # dynamo splits the graph here
        return self.b(y)


def test_graph_break_gives_one_captured_per_subgraph(capsys):
    captured = fxdream.capture(Printing(), (torch.randn(2, 4),), training=True)
    assert isinstance(captured, tuple) and len(captured) == 2
    assert [c.index for c in captured] == [0, 1]
    layers = [{n.meta[LAYER] for n in _compute_nodes(c.forward)} for c in captured]
    assert "a" in layers[0] and "b" in layers[1]
    assert all(c.backward is not None for c in captured)


def test_capture_of_a_disabled_forward_raises_with_reason():
    class Disabled(nn.Module):
        @torch._dynamo.disable
        def forward(self, x):
            return x + 1

    with pytest.raises(fxdream.CaptureError, match="nothing was captured from Disabled"):
        fxdream.capture(Disabled(), (torch.randn(3),))


class GRUHead(nn.Module):
    """Dynamo gives up on this forward in training (the GRU); torch.fx cannot trace it (a branch
    on a shape), so inference goes through dynamo too."""

    def __init__(self):
        super().__init__()
        self.gru, self.fc = nn.GRU(8, 16, batch_first=True), nn.Linear(16, 3)

    def forward(self, x):
        h, _ = self.gru(x)
        return self.fc(h[:, -1] if x.shape[1] > 2 else h[:, 0])


def test_a_function_dynamo_gave_up_on_in_training_is_captured_in_a_later_inference_build():
    x = torch.randn(2, 5, 8)
    trained = fxdream.optimize(GRUHead().train(), (x,), training=True, cost=None)
    # in training only the head is captured (fxdream.blockwise); the forward and the GRU run eagerly
    assert trained.report.capture.startswith("dynamo per block") and len(trained.report.graphs) == 1
    assert trained.report.graph_breaks == ("Attempted to wrap RNN, GRU, or LSTM — Dynamo does not support RNN, "
                                           "GRU, or LSTM. (dynamo ran the function it was tracing there eagerly)",)
    model = GRUHead().eval()
    inferred = fxdream.optimize(model, (x,), cost=None)
    assert not inferred.report.ran_eagerly and len(inferred.report.graphs) == 1
    with torch.no_grad():
        torch.testing.assert_close(inferred(x), model(x))


class LinearBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return self.lin(x)


class BlocksInALoop(nn.Module):
    """A graph break inside the loop: dynamo gives up on forward and compiles LinearBlock.forward
    once, its parameters lifted to inputs, for both blocks (torch.fx cannot trace the branch on
    a shape, so inference goes through dynamo too)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([LinearBlock(), LinearBlock()])

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            if x.shape[-1] == 4:
                print(end="")
        return x


class DoubleTheOutput:
    """Not equal to eager on purpose: shows which graph ran."""
    name = "test_capture_double_the_output"

    def applies_to(self, ctx):
        return None if ctx.frozen else "inference forward only"

    def __call__(self, gm, ctx):
        from fxdream.pass_api import PassResult
        output = gm.graph.output_node()
        (value,) = output.args[0]
        with gm.graph.inserting_before(output):
            doubled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (value, 2.0))
        doubled.meta["val"] = value.meta.get("val")
        output.args = ((doubled,),)
        gm.recompile()
        return PassResult(gm, True, "doubled")


def test_a_rewrite_of_a_graph_shared_by_two_instances_runs_only_for_the_state_it_saw():
    """A rewrite may take the parameters as constants (BatchNorm folded): when dynamo calls the
    same graph with another instance's parameters, the graph as captured runs instead."""
    model, x = BlocksInALoop().eval(), torch.randn(2, 4)
    optimized = fxdream.optimize(model, (x,), passes=[DoubleTheOutput()], cost=None)
    assert len(optimized.report.graphs) == 1  # one graph for both blocks
    first, second = model.blocks
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), second.lin(2 * first.lin(x)))



@pytest.mark.parametrize("training", [False, True])
def test_a_lazy_module_keeps_what_its_first_call_set(training):
    """A forward's Python side effects are the model's: a lazy module's first call (in the build)
    sets its sizes and swaps its class, and the build leaves them so. Initialized before the
    capture, its weights are read like any module's: an inference build traces it with torch.fx."""
    model, x = nn.Sequential(nn.LazyLinear(4), nn.ReLU()).train(training), torch.randn(3, 5)
    optimized = fxdream.optimize(model, (x,), training=training, cost=None)
    assert type(model[0]) is nn.Linear and model[0].in_features == 5
    assert optimized.report.capture == ("dynamo (training)" if training else "torch.fx symbolic_trace")
    with torch.set_grad_enabled(training):
        torch.testing.assert_close(optimized(x), model(x))


@pytest.mark.parametrize("training", [False, True])
def test_lazy_batch_norm_buffers_are_initialized_without_a_statistics_update_and_equal_eager(training):
    """A lazy BatchNorm's buffers do not exist before its first call, and a build keeps buffers as
    they were: the call that gives them their shapes updates no statistics (eval mode)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyConv2d(8, 3), nn.LazyBatchNorm2d(), nn.ReLU()).train(training)
    x = torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,), training=training, cost=None)
    assert model[1].num_batches_tracked.item() == 0 and bool((model[1].running_var == 1).all())
    assert fxdream.capture(model, (x,), training=training) is not None
    plain = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).train(training)
    plain.load_state_dict(model.state_dict())
    with torch.set_grad_enabled(training):
        torch.testing.assert_close(optimized(x), plain(x))
    torch.testing.assert_close(model[1].running_mean, plain[1].running_mean)


def test_a_training_capture_leaves_the_callers_autograd_graph_alone():
    """An input made by the caller's graph (``leaf * 2``): capturing, simulating and verifying
    a training step must not backpropagate into that graph (adding to ``leaf.grad``, freeing the
    buffers the caller's own backward needs)."""
    torch.manual_seed(0)
    model = Net().train()
    leaf = torch.randn(2, 3, 8, 8, requires_grad=True)
    x = leaf * 2
    fxdream.capture(model, (x,), training=True)
    fxdream.simulate(model, (x,), device="cpu", training=True)
    assert leaf.grad is None
    model(x).sum().backward()  # raised "backward through the graph a second time" when the capture did
    expected, = torch.autograd.grad(model(leaf * 2).sum(), leaf)
    torch.testing.assert_close(leaf.grad, expected)


def test_torchs_fast_path_transformer_layer_counts_its_gemms_flops():
    """An nn.TransformerEncoderLayer in eval with batch-first inputs runs as torch's fused
    ``_transformer_encoder_layer_fwd``, which flop_counter has no formula for. Its FLOPs are
    those of its GEMMs: q/k/v projections (E×3E), q·kᵀ and probs·v, output projection (E×E)
    and the feed-forward pair (E×F, F×E)."""
    batch, tokens, width, ffn = 2, 10, 64, 128
    layer = nn.TransformerEncoderLayer(width, 4, ffn, batch_first=True).eval()
    encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    captured = fxdream.capture(encoder, (torch.randn(batch, tokens, width),))
    ops = [op_name(n) for _, gm in captured.graphs() for n in _compute_nodes(gm)]
    assert ops.count("aten._transformer_encoder_layer_fwd") == 2
    rows = batch * tokens
    per_layer = (2 * rows * width * 3 * width + 2 * 2 * batch * tokens * tokens * width
                 + 2 * rows * width * width + 2 * 2 * rows * width * ffn)
    assert captured.total_flops() == 2 * per_layer


def test_torchs_fast_path_attention_counts_its_projections_and_both_products():
    """``_native_multi_head_attention`` (nn.MultiheadAttention's fused eval kernel): q and output
    projections over the queries, k and v projections over the keys, q·kᵀ and probs·v."""
    width, heads, batch, queries, keys = 16, 2, 3, 5, 7

    def attention(q, k, v, w_qkv, b_qkv, w_out, b_out):
        return torch._native_multi_head_attention(q, k, v, width, heads, w_qkv, b_qkv, w_out, b_out,
                                                  need_weights=False)[0]
    args = (torch.randn(batch, queries, width), torch.randn(batch, keys, width), torch.randn(batch, keys, width),
            torch.randn(3 * width, width), torch.randn(3 * width), torch.randn(width, width), torch.randn(width))
    gm = make_fx(attention, tracing_mode="fake")(*args)
    node = next(n for n in gm.graph.nodes if op_name(n) == "aten._native_multi_head_attention")
    assert node_flops(node) == (2 * width * width * (2 * batch * queries + 2 * batch * keys)
                                + 2 * 2 * batch * queries * keys * width)


def test_dynamos_warning_that_a_capture_failed_on_a_graph_is_not_shown_for_fxdreams_own():
    """A data-dependent op fails every capture on its graph, dynamo breaks the graph there and
    warns, advising a report to the backend's authors; fxdream's report lists the break instead."""
    dynamo_log = logging.getLogger("torch._dynamo.exc")

    def record(backend: str) -> logging.LogRecord:
        message = (f"Graph break in user code\n  Graph break under GenericContextWrappingVariable\n"
                   f"  Explanation: Backend compiler `{backend}` failed with aten.nonzero.default. "
                   f"Adding a graph break.\n  Hint: Report an issue to the backend compiler repo.\n\n"
                   f"  Developer debug context: Backend: {backend}\n gb_type: Backend compiler exception")
        return logging.LogRecord("torch._dynamo.exc", logging.WARNING, __file__, 1, message, None, None)
    assert not dynamo_log.filter(record("<fxdream.capturing.session.CaptureSession object at 0x7f>"))
    assert dynamo_log.filter(record("inductor"))  # another backend's failure is shown as dynamo shows it


def test_a_dynamically_quantized_model_is_captured_the_same_way_every_time():
    """Its packed weights are TorchScript objects without __eq__: the fake-tensor cache's key
    comparison raised on the second capture, which then took dynamo's path with a break."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.ao's deprecation of eager-mode quantization
        model = torch.ao.quantization.quantize_dynamic(
            torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8)).eval(),
            {torch.nn.Linear}, dtype=torch.float16)
    x = torch.randn(4, 32)
    codes = {fxdream.capture(model, (x,)).torch_graph.code for _ in range(2)}
    assert len(codes) == 1
