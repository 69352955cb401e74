"""GRU / vanilla-RNN layers stay one op in inference graphs (fxdream.rnn_op), equal to eager."""
import pytest
import torch
import torch.nn as nn

import fxdream
from fxdream.ir.flops import node_flops
from fxdream.ops.rnn import rnn_inference
from conftest import assert_same_training_step


class Recurrent(nn.Module):
    def __init__(self, kind: str):
        super().__init__()
        self.emb = nn.Linear(6, 8)
        if kind == "gru":
            self.rnn = nn.GRU(8, 12, num_layers=2, batch_first=True, bidirectional=True)
        else:
            self.rnn = nn.RNN(8, 12, nonlinearity=kind, batch_first=True)
        self.fc = nn.Linear(self.rnn.hidden_size * (2 if self.rnn.bidirectional else 1), 3)

    def forward(self, x):
        y, h = self.rnn(self.emb(x))
        return self.fc(y[:, -1]) + h.sum(0).mean()


class RecurrentWithKwargs(Recurrent):
    """**kwargs keep torch.fx off: the dynamo path."""
    def forward(self, x, **unused):
        return super().forward(x)


def _call_functions(optimized):
    return [n for c in optimized.captured for n in c.forward.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("kind", ["gru", "tanh", "relu"])
@pytest.mark.parametrize("cls", [Recurrent, RecurrentWithKwargs], ids=["torch.fx", "dynamo"])
def test_an_rnn_layer_is_one_op_in_inference_and_exact(kind, cls):
    torch.manual_seed(0)
    model, x = cls(kind).eval(), torch.randn(3, 16, 6)
    optimized = fxdream.optimize(model, (x,), passes="auto", eager_check=False)  # the graph is under test
    assert optimized.report.capture.startswith("torch.fx" if cls is Recurrent else "dynamo")
    nodes = _call_functions(optimized)
    rnn = [n for n in nodes if n.target is rnn_inference]
    assert len(rnn) == 1 and node_flops(rnn[0]) > 0
    assert len(nodes) < 30  # not one group of ops per time step (16 steps × 2 layers × 2 directions)
    # auto may time oneDNN's linear faster than MKL's (it did under CI's load): other rounding there
    prepacked = any(r.applied for r in optimized.report.passes if r.name == "prepack_linear")
    same = (lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)) if prepacked else torch.equal
    with torch.no_grad():
        assert same(optimized(x), model(x))
        x2 = torch.randn(5, 9, 6)  # another batch and length: recompiles, still exact
        assert same(optimized(x2), model(x2))


@pytest.mark.parametrize("training", [False, True])
def test_a_build_leaves_the_rnn_holding_its_own_weights(training):
    # the capture runs the GRU on aot's fake parameters; left in _flat_weights, the model's next
    # forward swapped them back (a Python side effect): a second build lost the torch.fx path
    torch.manual_seed(0)
    model, x = Recurrent("gru").train(training), torch.randn(3, 5, 6)
    for _ in range(2):
        optimized = fxdream.optimize(model, (x,), training=training, eager_check=False)
        gru = model.rnn
        assert all(w is getattr(gru, name) for w, name in zip(gru._flat_weights, gru._flat_weights_names))
        if not training:
            assert optimized.report.capture == "torch.fx symbolic_trace"


def test_training_with_an_rnn_is_unchanged():
    torch.manual_seed(0)
    model, x = Recurrent("gru").train(), torch.randn(3, 5, 6)
    optimized = fxdream.optimize(model, (x,), training=True)
    assert not any(n.target is rnn_inference for n in _call_functions(optimized))
    assert_same_training_step(model, optimized, (x,))


@pytest.mark.parametrize("batch_first", [False, True])
def test_the_op_matches_torch_vf_and_its_fake_shapes_and_strides(batch_first):
    gru = nn.GRU(4, 5, num_layers=2, bidirectional=True, batch_first=batch_first).eval()
    x, hx = torch.randn(7, 2, 4), torch.zeros(4, 7 if batch_first else 2, 5)
    out, h = rnn_inference(x, hx, list(gru._flat_weights), "gru", True, 2, True, batch_first)
    ref_out, ref_h = gru(x, hx)
    assert torch.equal(out, ref_out) and torch.equal(h, ref_h)
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode() as mode:
        fake = rnn_inference(mode.from_tensor(x), mode.from_tensor(hx),
                             [mode.from_tensor(w) for w in gru._flat_weights], "gru", True, 2, True, batch_first)
    assert [(tuple(t.shape), t.stride()) for t in fake] == [(tuple(t.shape), t.stride()) for t in (ref_out, ref_h)]


class AllStepsHead(nn.Module):
    """A head on every step of a batch_first GRU's output, which is not contiguous in eager."""
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(6, 8, 3, padding=1)
        self.rnn, self.fc = nn.GRU(8, 12, batch_first=True, bidirectional=True), nn.Linear(24, 2)

    def forward(self, x):
        y, _ = self.rnn(torch.relu(self.conv(x)).transpose(1, 2))
        return self.fc(y).sum(1)


def test_a_batch_first_output_used_whole_is_captured_and_exact():
    # the op's fake output once claimed contiguous strides: the Linear's view traced, then failed
    # on the real (time-major) output, and the model ran eagerly
    torch.manual_seed(0)
    model, x = AllStepsHead().eval(), torch.randn(3, 6, 10)
    optimized = fxdream.optimize(model, (x,), passes="auto", eager_check=False, strict=True)
    assert any(n.target is rnn_inference for n in _call_functions(optimized))
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))


def test_the_analytic_cost_of_a_recurrence_is_at_least_its_steps_in_sequence():
    from fxdream.ir.flops import rnn_sequential_steps
    from fxdream.sim.cost.analytic import Analytic
    from fxdream.sim.cost.devices import get_device
    model, x = Recurrent("gru").eval(), torch.randn(3, 16, 6)
    captured = fxdream.capture(model, (x,))
    (rnn,) = [n for n in captured.forward.graph.nodes if n.target is rnn_inference]
    assert rnn_sequential_steps(rnn) == 16 * 2  # batch_first: steps from dim 1; two layers
    h100 = get_device("h100")
    # a few kFLOPs per step: the roofline says ~1 µs, the recurrence 32 steps of two kernels
    assert Analytic(h100).kernel_us(rnn) == pytest.approx(2 * 32 * h100.kernel_min_us)


def test_a_gpu_host_pays_a_launch_for_every_kernel_of_a_recurrence():
    """cuDNN runs an RNN step by step: per layer and direction one GEMM over all inputs, then a
    GEMM and a pointwise kernel per step. The host launches each one, which at small sizes is
    most of an RNN's time; one launch per op would predict a 2-layer bidirectional GRU as cheap
    to queue as a single Linear."""
    from fxdream.ir.flops import rnn_kernel_launches
    from fxdream.sim.cost.analytic import Analytic
    from fxdream.sim.cost.devices import get_device
    model, x = Recurrent("gru").eval(), torch.randn(3, 16, 6)
    captured = fxdream.capture(model, (x,))
    (rnn,) = [n for n in captured.forward.graph.nodes if n.target is rnn_inference]
    (linear,) = [n for n in captured.forward.graph.nodes if n.name == "addmm"][:1]
    assert rnn_kernel_launches(rnn) == 2 * 2 * (1 + 2 * 16) and rnn_kernel_launches(linear) == 0
    h100 = Analytic(get_device("h100"))
    assert h100.dispatch_us(rnn) - h100.dispatch_us(linear) == pytest.approx(
        h100.device.host_us("other") - h100.device.host_us("gemm") + (132 - 1) * h100.device.launch_overhead_us)


def test_passes_and_profiling_run_outside_the_tracing_mode():
    # the mode's Python hook on every torch call would be counted as op time by the profile
    from fxdream.capturing.session import CaptureSession
    from fxdream.capturing.steps import run_once
    from fxdream.capturing.torch_fx import trace_and_compile
    seen = []

    def transform(gm, phase, index, params, inputs):
        seen.append(type(torch.overrides._get_current_function_mode()).__name__)
        return gm
    model, x = Recurrent("gru").eval(), torch.randn(2, 5, 6)
    session = CaptureSession(model, transform=transform)
    with torch.no_grad():
        runner, reason = trace_and_compile(model, (x,), session)
        assert reason is None
        run_once(runner, model, (x,), False)
    assert seen == ["NoneType"]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_gru_on_cuda_is_one_op_and_equal_to_eager():
    torch.manual_seed(0)
    model, x = Recurrent("gru").eval().cuda(), torch.randn(3, 16, 6, device="cuda")
    optimized = fxdream.optimize(model, (x,), eager_check=False)
    assert sum(n.target is rnn_inference for n in _call_functions(optimized)) == 1
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), rtol=1e-4, atol=1e-5)


def test_the_tracing_mode_is_entered_only_for_graphs_that_may_need_it():
    """Its hook on every torch call slows the trace: a conv net goes without it; an RNN, SDPA,
    upsampling, circular padding, 1-d max pooling, a leaf module holding one, or a call into
    unknown Python gets it."""
    import torch.fx as fx
    import torch.nn.functional as F
    from fxdream.ops.keep_whole import may_call_whole_ops

    class Attend(torch.nn.Module):
        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q)

    class Custom(torch.nn.Module):
        def forward(self, x):
            return _opaque(x)

    conv = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU())
    assert not may_call_whole_ops(fx.symbolic_trace(conv))
    assert may_call_whole_ops(fx.symbolic_trace(Attend()))
    assert may_call_whole_ops(fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GRU(4, 4))))
    assert may_call_whole_ops(fx.symbolic_trace(torch.nn.Sequential(torch.nn.TransformerEncoderLayer(8, 2))))
    assert may_call_whole_ops(fx.symbolic_trace(Custom()))
    up = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Upsample(scale_factor=2))
    circular = torch.nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular")
    leaves = lambda model: fx.symbolic_trace(torch.nn.Sequential(model))  # noqa: E731  (torch.nn modules as leaves)
    for model in (up, circular, torch.nn.MaxPool1d(2), torch.nn.CircularPad2d(1)):
        assert may_call_whole_ops(leaves(model))
    # in training only upsampling, SDPA and RNNs have whole ops with gradient formulas (SDPA's and RNNs' on meta)
    assert may_call_whole_ops(leaves(up), training=True)
    assert may_call_whole_ops(fx.symbolic_trace(Attend()), training=True)
    assert may_call_whole_ops(leaves(torch.nn.GRU(4, 4)), training=True)
    for model in (circular, torch.nn.MaxPool1d(2), conv):
        assert not may_call_whole_ops(leaves(model), training=True)
    assert may_call_whole_ops(fx.symbolic_trace(Custom()), training=True)


@torch.fx.wrap
def _opaque(x):
    return x + 1


class ProjectedLSTM(torch.nn.Module):
    def __init__(self, batch_first: bool):
        super().__init__()
        self.lstm = torch.nn.LSTM(6, 8, proj_size=3, num_layers=2, bidirectional=True, batch_first=batch_first)

    def forward(self, x):
        return self.lstm(x)  # (output, (h, c)), returned as the leaf module gives it


class ProjectedLSTMWithKwargs(ProjectedLSTM):
    """**kwargs keep torch.fx off: the dynamo path."""
    def forward(self, x, **unused):
        return super().forward(x)


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("cls", [ProjectedLSTM, ProjectedLSTMWithKwargs], ids=["torch.fx", "dynamo"])
def test_an_lstm_with_projections_is_one_op_on_cpu_and_exact(batch_first, cls):
    # oneDNN does not take projections: eager runs ATen's C++ loop, which a trace unrolled into
    # ops per time step (256 wide, 50 steps: 1218 nodes, 1.7x eager's time)
    from fxdream.ops.rnn import lstm_inference
    torch.manual_seed(0)
    model, x = cls(batch_first).eval(), torch.randn(3, 5, 6)
    with torch.no_grad():
        expected = model(x)
    optimized = fxdream.optimize(model, (x,), cost=None)
    targets = [n.target for n in _call_functions(optimized)]
    assert targets.count(lstm_inference) == 1 and torch.ops.aten.sigmoid.default not in targets
    actual = optimized(x)
    for a, e in zip(torch.utils._pytree.tree_leaves(actual), torch.utils._pytree.tree_leaves(expected)):
        assert torch.equal(a, e) and a.stride() == e.stride()


def test_an_lstm_without_projections_keeps_onednns_layer():
    from fxdream.ops.rnn import lstm_inference
    model, x = ProjectedLSTM(True).eval(), torch.randn(3, 5, 6)
    model.lstm = torch.nn.LSTM(6, 8, batch_first=True)
    optimized = fxdream.optimize(model, (x,), cost=None)
    assert lstm_inference not in [n.target for n in _call_functions(optimized)]


class LastStep(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.fc = torch.nn.LSTM(6, 8, batch_first=True), torch.nn.Linear(8, 3)

    def forward(self, x):
        y, _ = self.lstm(x)
        return self.fc(y[:, -1])


@pytest.mark.parametrize("passes", [(), "auto"])
def test_an_lstm_called_with_an_empty_batch_returns_empty_outputs_as_eager(passes):
    # torch's LSTM decomposition sends an empty input to oneDNN's layer, which dies of a division
    # by zero (SIGFPE: the process, not an exception); eager's LSTM returns empty outputs
    model, x = LastStep().eval(), torch.randn(4, 5, 6)
    optimized = fxdream.optimize(model, (x,), passes=passes, eager_check=False)
    empty = torch.randn(0, 5, 6)
    with torch.no_grad():
        expected = model(empty)
    actual = optimized(empty)
    assert actual.shape == expected.shape == (0, 3)
    with torch.no_grad():  # the full batch still runs oneDNN's layer, equal to eager
        torch.testing.assert_close(optimized(x), model(x))


@pytest.mark.parametrize("bias", [True, False])
def test_onednns_lstm_layer_counts_its_two_weight_matrices(bias):
    # without biases the layer takes zeros of the weights' shapes in their place: not more weights
    from fxdream.ir.flops import node_flops
    captured = fxdream.capture(nn.LSTM(8, 16, bias=bias).eval(), (torch.randn(7, 3, 8),))
    (layer,) = [n for n in captured.forward.graph.nodes if str(n.target) == "aten.mkldnn_rnn_layer.default"]
    assert node_flops(layer) == 2 * 21 * (64 * 8 + 64 * 16)


class MonteCarlo(nn.Module):
    """An eval model whose stacked RNN stays in train mode: dropout between its layers per call."""

    def __init__(self, cls):
        super().__init__()
        self.rnn = cls(6, 12, num_layers=3, dropout=0.5, batch_first=True)
        self.head = nn.Linear(12, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


@pytest.mark.parametrize("cls", [nn.GRU, nn.RNN, nn.LSTM])
def test_an_rnn_left_in_train_mode_keeps_its_dropout_in_an_inference_build(cls):
    """torch's decomposition of a train-mode RNN leaves the dropout between layers out: the
    layer is kept whole and draws eager's dropout from eager's generator."""
    torch.manual_seed(0)
    model, x = MonteCarlo(cls).eval(), torch.randn(2, 5, 6)
    model.rnn.train()
    optimized = fxdream.optimize(model, (x,), eager_check=False, cost=None)
    ops = {str(n.target) for g in optimized.captured for n in g.forward.graph.nodes if n.op == "call_function"}
    assert ops & {"fxdream.rnn_dropout.default", "fxdream.lstm_dropout.default"}, ops
    with torch.no_grad():
        torch.manual_seed(7)
        expected = model(x)
        torch.manual_seed(7)
        torch.testing.assert_close(optimized(x), expected)
        assert not torch.equal(optimized(x), optimized(x))  # a draw per call


def test_an_lstm_on_a_gpu_is_kept_whole_in_inference():
    """A trace unrolls a GPU LSTM into ops per time step where eager runs cuDNN's layer: the
    capture keeps it one op instead (checked on fake CUDA tensors: no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from fxdream.ops.rnn import redirect_lstm
    shapes = [p.shape for p in nn.LSTM(6, 8, num_layers=2, batch_first=True)._flat_weights]
    with FakeTensorMode():
        params = [torch.randn(shape, device="cuda") for shape in shapes]
        x = torch.randn(3, 5, 6, device="cuda")
        h = torch.zeros(2, 3, 8, device="cuda")
        with torch.no_grad():
            output, hy, cy = redirect_lstm((x, (h, h), params, True, 2, 0.0, False, False, True), {})
    assert output.device.type == "cuda" and output.shape == (3, 5, 8) and hy.shape == cy.shape == (2, 3, 8)
