"""Inference capture through torch.fx.symbolic_trace (no dynamo), and its fallbacks to dynamo."""
import collections
import copy
import dataclasses
import inspect

import pytest
import torch
import torch.nn as nn
from conftest import ConvBnNet, assert_step_matches

import fxdream
from fxdream.capturing.session import CaptureSession
from fxdream.capturing.torch_fx import trace_and_compile
from fxdream.capturing.trace_check import probe_samples
from fxdream.numerics import max_abs_diff


class IsinstanceBranch(nn.Module):
    """A Proxy is not a Tensor: torch.fx silently takes the other branch."""
    def forward(self, x):
        if isinstance(x, torch.Tensor):
            return x * 2
        return x + 100


class DataDependent(nn.Module):
    def forward(self, x):
        return x * 2 if x.sum().item() > 0 else x * 3


class OptionalMask(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, mask=None):
        y = self.lin(x)
        if mask is not None:
            y = y * mask
        return {"out": y, "pair": (y.sum(), y.relu())}


def _eval_optimize(model, x, **kwargs):
    return fxdream.optimize(model.eval(), (x,), **kwargs)


def test_traceable_model_is_captured_by_torch_fx_and_folds_batchnorm():
    model, x = ConvBnNet(), torch.randn(2, 3, 8, 8)
    # cost=None: the pass's default variant (a measured choice may decline on a model this small)
    optimized = _eval_optimize(model, x, passes=["fuse_conv_bias_act"], cost=None)
    report = optimized.report
    assert report.capture == "torch.fx symbolic_trace"
    assert "symbolic_trace" in report.to_markdown()
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), rtol=1e-4, atol=1e-5)
    # the pass saw the model's weights as constants (BN folded), as under dynamo
    applied = [r for r in report.passes if r.name == "fuse_conv_bias_act"]
    assert applied and applied[0].applied
    rewritten = optimized.rewritten_graphs[(0, "fw")]
    ops = {str(n.target) for n in rewritten.graph.nodes if n.op == "call_function"}
    assert not any("batch_norm" in op for op in ops), ops
    # the layer names come from torch.fx's module stack
    assert {"conv", "fc"} <= {s.layer for s in optimized.captured[0].layers()}


def test_parameters_and_buffers_are_the_captured_state():
    model, x = ConvBnNet().eval(), torch.randn(1, 3, 8, 8)
    optimized = _eval_optimize(model, x)
    captured = optimized.captured[0]
    state = {id(t) for t in list(model.parameters()) + list(model.buffers())}
    n_state = len(list(model.parameters())) + len(list(model.buffers()))
    assert captured.state_positions == frozenset(range(n_state))
    # detached copies that share the model's storage, then the input
    assert [x.untyped_storage().data_ptr() for x in captured.example_inputs[:n_state]] == \
           [t.untyped_storage().data_ptr() for t in list(model.parameters()) + list(model.buffers())]
    assert not any(id(t) in state for t in captured.example_inputs)


def test_a_trace_that_disagrees_with_eager_falls_back_to_dynamo():
    model, x = IsinstanceBranch(), torch.randn(3)
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture.startswith("dynamo (the torch.fx trace's output differs from eager")
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), x * 2)


def test_an_untraceable_model_is_captured_by_dynamo_with_the_reason():
    model, x = DataDependent(), torch.randn(3)
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture.startswith("dynamo (torch.fx cannot trace it (TraceError")
    # the model's line that torch.fx stopped at, which torch.fx's own message does not give
    line = inspect.getsourcelines(DataDependent.forward)[1] + 1
    assert f"at test_fx_capture.py:{line} `return x * 2 if x.sum().item() > 0 else x * 3`" in optimized.report.capture
    assert optimized.report.graph_breaks  # dynamo broke at the data-dependent branch, as before
    with torch.no_grad():
        torch.testing.assert_close(optimized(-x.abs()), -x.abs() * 3)


def test_defaults_are_fixed_and_nested_outputs_rebuilt():
    model, x = OptionalMask(), torch.randn(2, 4)
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture == "torch.fx symbolic_trace"
    with torch.no_grad():
        out, expected = optimized(x), model(x)
    assert out.keys() == expected.keys() and isinstance(out["pair"], tuple)
    torch.testing.assert_close(out, expected)


class ScaledByDefault(nn.Module):
    """A number default the forward computes with: fx guards it with ``assert scale == 2.0``."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, scale=2.0):
        return self.lin(x) * scale


def test_a_number_default_is_fixed_and_other_values_go_through_dynamo():
    model, x = ScaledByDefault(), torch.randn(2, 4)
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture == "torch.fx symbolic_trace"
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))
        torch.testing.assert_close(optimized(x, 3.0), model(x, 3.0))
        torch.testing.assert_close(optimized(x, scale=0.5), model(x, scale=0.5))
        torch.testing.assert_close(optimized(x), model(x))
    assert optimized.report.fallback_reason is None


def test_other_calls_go_through_dynamo_and_stay_correct():
    model, x = ConvBnNet().eval(), torch.randn(2, 3, 8, 8)
    optimized = _eval_optimize(model, x)
    with torch.no_grad():
        bigger = torch.randn(3, 3, 16, 16)
        torch.testing.assert_close(optimized(bigger), model(bigger))
        torch.testing.assert_close(optimized(x + 1), model(x + 1))  # the example's signature: fx
    assert [g.input_shapes for g in optimized.report.graphs] == [((2, 3, 8, 8),), ((3, 3, 16, 16),)]
    model.train()  # a flag the trace baked in: dynamo captures again, in training mode
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))
    assert len(optimized.report.graphs) == 3


class ScaleFirstInput(nn.Module):
    """Updates its first input in place, then reads the second: ``m(x, x)`` reads the update."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, a, b):
        a.mul_(2)
        return self.lin(a + b)


def test_inputs_sharing_memory_go_through_dynamo_where_forward_updates_an_input():
    torch.manual_seed(0)
    model = ScaleFirstInput().eval()
    optimized = fxdream.optimize(model, (torch.randn(3, 6), torch.randn(3, 6)))
    assert optimized.report.capture == "torch.fx symbolic_trace"
    x = torch.randn(3, 6)
    with torch.no_grad():
        expected_x = x.clone()
        expected = model(expected_x, expected_x)  # 2x + 2x
        actual = optimized(x, x)                  # the traced graph alone: 2x + x
    assert torch.equal(actual, expected) and torch.equal(x, expected_x)
    assert len(optimized.report.graphs) == 2  # captured again by dynamo


def test_a_call_under_autocast_goes_through_dynamo_and_gets_eagers_dtypes():
    torch.manual_seed(0)
    model, x = ConvBnNet().eval(), torch.randn(2, 3, 8, 8)
    optimized = _eval_optimize(model, x, passes=["fuse_conv_bias_act"])
    assert optimized.report.capture == "torch.fx symbolic_trace"
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        expected, actual = model(x), optimized(x)
    assert actual.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(actual, expected)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # built under autocast: dynamo, which guards it
        built_under = _eval_optimize(model, x)
    assert built_under.report.capture.startswith("dynamo (built under autocast")


def test_training_is_captured_by_dynamo():
    model, x = ConvBnNet(), torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,), training=True)
    assert optimized.report.capture == "dynamo (training)"


def test_a_failing_compile_leaves_the_session_empty():
    class Opaque(nn.Module):
        def forward(self, x):
            return torch.ops.fxdream_test_fx.no_fake(x)

    lib = torch.library.Library("fxdream_test_fx", "DEF")
    lib.define("no_fake(Tensor x) -> Tensor")
    lib.impl("no_fake", lambda x: x * 2, "CPU")
    session = CaptureSession(None)
    with torch.no_grad():
        runner, reason = trace_and_compile(Opaque().eval(), (torch.randn(3),), session)
    assert runner is None and reason.startswith("aot_autograd failed on the torch.fx trace")
    assert session.records == []


class CountsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x + 1


def test_python_side_effects_in_forward_keep_dynamo():
    model, x = CountsCalls(), torch.randn(3)
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture.startswith("dynamo (forward changes the modules' Python attributes")
    before = model.calls
    with torch.no_grad():
        optimized(x)
    assert model.calls == before + 1


class CountsInABuffer(nn.Module):
    """The trace runs ``+= 1`` once, on the real buffer, and records only the multiply."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        self.steps += 1
        return self.lin(x) * self.steps


def test_a_buffer_updated_in_place_keeps_dynamo_and_matches_eager():
    torch.manual_seed(0)
    model, x = CountsInABuffer().eval(), torch.randn(2, 4)
    reference = CountsInABuffer().eval()
    reference.load_state_dict(model.state_dict())
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture == ("dynamo (forward updates a parameter or buffer in place "
                                        "(a trace would do it only once))")
    assert model.steps.item() == 0  # building left the state as it was
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(optimized(x), reference(x), rtol=0, atol=0)
    assert model.steps.item() == reference.steps.item() == 3


LogitsAndHidden = collections.namedtuple("LogitsAndHidden", "logits hidden")


class NamedTupleOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        hidden = torch.relu(self.lin(x))
        return LogitsAndHidden(hidden.sum(-1), hidden)


def test_a_namedtuple_output_is_rebuilt_from_its_fields():
    model, x = NamedTupleOut().eval(), torch.randn(2, 4)
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture == "torch.fx symbolic_trace"
    with torch.no_grad():
        out, expected = optimized(x), model(x)
    assert type(out) is LogitsAndHidden
    torch.testing.assert_close(out.logits, expected.logits)
    torch.testing.assert_close(out.hidden, expected.hidden)


class ReturnsTheLeafsTuple(nn.Module):
    """A leaf module's own tuple as the output: the trace cannot know it is one until it runs."""

    def __init__(self, leaf):
        super().__init__()
        self.leaf = leaf

    def forward(self, x):
        return self.leaf(x)


class _AttentionWithoutWeights(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x):
        return self.attention(x, x, x, need_weights=False)  # the leaf returns (output, None)


@pytest.mark.parametrize("leaf, x", [(nn.LSTM(4, 6, batch_first=True), torch.randn(2, 5, 4)),
                                     (nn.LSTMCell(4, 6), torch.randn(2, 4))], ids=["LSTM", "LSTMCell"])
def test_a_leaf_modules_tuple_output_is_expanded_for_aot_and_rebuilt(leaf, x):
    model = ReturnsTheLeafsTuple(leaf).eval()
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture == "torch.fx symbolic_trace"  # was: dynamo, aot's output spec mismatch
    with torch.no_grad():
        out, expected = optimized(x), model(x)
    assert torch.utils._pytree.tree_structure(out) == torch.utils._pytree.tree_structure(expected)
    assert all(torch.equal(a, b) for a, b in zip(torch.utils._pytree.tree_leaves(out),
                                                 torch.utils._pytree.tree_leaves(expected)))


def test_a_leaf_output_holding_something_other_than_tensors_goes_through_dynamo():
    model, x = _AttentionWithoutWeights().eval(), torch.randn(2, 5, 8)
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture == "dynamo (an output that is not a tensor)"
    with torch.no_grad():
        out, expected = optimized(x), model(x)
    assert out[1] is None
    torch.testing.assert_close(out[0], expected[0])  # eager's fast path rounds differently


class ScoresAndMask(nn.Module):
    def forward(self, x):
        return x.softmax(-1), x.argmax(-1), x > 0


def test_integer_and_bool_outputs_are_compared_exactly():
    model, x = ScoresAndMask(), torch.randn(3, 5)
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture == "torch.fx symbolic_trace"
    with torch.no_grad():
        for got, want in zip(optimized(x), model(x)):
            assert torch.equal(got, want) if not got.is_floating_point() else torch.allclose(got, want)


def test_anything_failing_on_the_fx_path_falls_back_to_dynamo(monkeypatch):
    import fxdream.capturing.torch_fx as fx_capture

    def broken(*args):
        raise RuntimeError("simulated bug")
    monkeypatch.setattr(fx_capture, "_flatten_outputs", broken)
    model, x = ConvBnNet().eval(), torch.randn(2, 3, 8, 8)
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture == "dynamo (the torch.fx path failed (RuntimeError: simulated bug))"
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))


def _cumulative_bn_net():
    """BatchNorm with momentum=None reads ``float(num_batches_tracked)`` (a graph break) inside
    nn.Sequential's loop: dynamo skips the whole frame and captures nothing."""
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8, momentum=None), nn.ReLU(),
                         nn.Conv2d(8, 4, 3, padding=1))


def test_dynamo_capturing_nothing_retries_on_the_torch_fx_trace():
    torch.manual_seed(0)
    model = _cumulative_bn_net().train()
    reference = _cumulative_bn_net().train()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(2, 3, 8, 8)
    fast = fxdream.optimize(model, (x,), training=True, passes=["fuse_conv_bias_act"], cost=None)
    report = fast.report
    assert not report.ran_eagerly and len(report.graphs) == 2
    assert "torch.fx trace" in report.to_markdown() and "captured nothing" in report.to_markdown()
    for batch in (2, 2, 3):  # the example's signature, then another through dynamo on the model
        assert_step_matches(fast, model, reference, torch.randn(batch, 3, 8, 8))
    assert len(fxdream.capture(_cumulative_bn_net().train(), (torch.randn(2, 3, 8, 8),), training=True)) == 2


class SideEffectInLoop(nn.Module):
    """A Python counter (the trace would bump it once) and a break in a loop: no capture at all."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        for layer in self.layers:
            x = layer(x)
            print(end="")  # a graph break inside the loop
        return x


def test_no_retry_on_a_trace_with_python_side_effects():
    model = SideEffectInLoop().train()
    fast = fxdream.optimize(model, (torch.randn(2, 4),), training=True, cost=None)
    x = torch.randn(2, 4)
    torch.testing.assert_close(fast(x), model.layers[1](model.layers[0](x)))
    assert "torch.fx trace" not in fast.report.to_markdown()


class LSTMLanguageModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lstm, self.fc = nn.Embedding(20, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 20)

    def forward(self, ids):
        hidden, _ = self.lstm(self.emb(ids))
        return self.fc(hidden)


def test_an_rnn_in_training_runs_eagerly_between_captured_graphs():
    """dynamo gives up on the whole forward at the LSTM in training; on the trace, the LSTM is a
    call dynamo does not trace, so the embedding and the head are captured around it."""
    torch.manual_seed(0)
    model, reference = LSTMLanguageModel().train(), LSTMLanguageModel().train()
    reference.load_state_dict(model.state_dict())
    ids = torch.randint(0, 20, (2, 7))
    fast = fxdream.optimize(model, (ids,), training=True, cost=None)
    assert not fast.report.ran_eagerly and len(fast.report.graphs) == 2
    assert any("LSTM in training runs eagerly" in b for b in fast.report.graph_breaks)
    assert_step_matches(fast, model, reference, ids)


def test_inference_tensors_and_builds_inside_inference_mode_work():
    torch.manual_seed(0)
    model = ConvBnNet().eval()
    with torch.inference_mode():
        x = torch.randn(2, 3, 8, 8)  # an inference tensor: it keeps no version counter
        expected = model(x)
    optimized = fxdream.optimize(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), expected)
    with torch.inference_mode():  # the whole build inside (its own timing loops make inference tensors)
        optimized = fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"])
        torch.testing.assert_close(optimized(x), expected)
    assert optimized.report.passes[0].applied


class FixedBatch(nn.Module):
    """forward reshapes to the batch size it was written for: a one-sample input is not valid."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(12, 3)

    def forward(self, x):
        return self.lin(x.reshape(4, 12))


class PerSample(nn.Module):
    """Returns one tensor per sample: how many follows the batch."""
    def forward(self, x):
        return torch.unbind(x * 2)


def test_the_trace_is_checked_on_two_samples_of_a_batch():
    model, x = IsinstanceBranch(), torch.randn(4, 3)
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture == ("dynamo (the torch.fx trace's output differs from eager on the example "
                                        "(its first and last samples))")
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))


def test_a_model_that_fixes_its_batch_size_is_checked_on_the_whole_example():
    model, x = FixedBatch(), torch.randn(4, 3, 4)
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture == "torch.fx symbolic_trace"
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))


def test_outputs_whose_number_follows_the_batch_are_checked_on_the_whole_example():
    model, x = PerSample(), torch.randn(5, 2)
    optimized = _eval_optimize(model, x)
    with torch.no_grad():
        got, want = optimized(x), model(x)
    assert len(got) == len(want) == 5
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)


def test_probe_samples_are_of_a_model_of_one_input_with_a_batch():
    x = torch.randn(4, 3)
    samples = probe_samples((x,))
    assert [tuple(t.shape) for t in samples] == [(2, 3)]
    assert torch.equal(samples[0], x[[0, 3]])
    samples[0].add_(1)  # copies: an in-place update by forward stays in them
    assert not torch.equal(x[[0, 3]], samples[0])
    assert probe_samples((torch.randn(2, 3),)) is None  # no fewer than the whole example
    assert probe_samples((x, torch.ones(4, 7))) is None  # a second input: the samples may differ in its branches
    assert probe_samples((torch.tensor(2.0),)) is None  # a scalar


class MaskUnderIsinstance(nn.Module):
    """An optional padding mask under an isinstance test, which a Proxy fails: the trace drops it."""
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, pad_mask):
        h = torch.tanh(self.proj(x))
        if isinstance(pad_mask, torch.Tensor):
            h = h.masked_fill(pad_mask.unsqueeze(-1), 0.0)
        return h.sum(1)


class OptionalLengths(nn.Module):
    """Lengths that the trace reads (the mean's divisor) and drops (the mask under isinstance)."""
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, lengths):
        h = torch.tanh(self.proj(x))
        if isinstance(lengths, torch.Tensor):
            h = h * (torch.arange(x.shape[1]) < lengths[:, None]).unsqueeze(-1)
        return h.sum(1) / lengths[:, None]


def _padded_batch():
    """Three sequences sorted by length: the first unpadded, the last padded the most."""
    lengths = torch.tensor([5, 4, 2])
    return torch.randn(3, 5, 4), lengths, torch.arange(5)[None, :] >= lengths[:, None]


def test_an_input_the_trace_never_reads_sends_the_model_to_dynamo():
    x, _, pad_mask = _padded_batch()
    model = MaskUnderIsinstance().eval()
    optimized = fxdream.optimize(model, (x, pad_mask))
    assert optimized.report.capture == (
        "dynamo (the torch.fx trace never reads the input 'pad_mask' (a branch on its type, such as "
        "isinstance(x, torch.Tensor), sees a Proxy while tracing))")
    with torch.no_grad():
        torch.testing.assert_close(optimized(x, pad_mask), model(x, pad_mask))


@pytest.mark.parametrize("order", [[0, 1, 2], [2, 1, 0], [0, 2, 1]])
def test_a_branch_some_samples_do_not_exercise_is_checked_on_the_whole_example(order):
    x, lengths, _ = _padded_batch()
    x, lengths = x[order], lengths[order]  # sorted, reversed, or neither: the padded sample anywhere
    model = OptionalLengths().eval()
    optimized = fxdream.optimize(model, (x, lengths))
    assert optimized.report.capture == "dynamo (the torch.fx trace's output differs from eager on the example)"
    with torch.no_grad():
        torch.testing.assert_close(optimized(x, lengths), model(x, lengths))


@dataclasses.dataclass
class LogitsAndFeatures:
    logits: torch.Tensor
    features: torch.Tensor


class DataclassOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        features = torch.relu(self.body(x))
        return LogitsAndFeatures(self.head(features), features)


def test_a_dataclass_output_is_trained_through_its_fields():
    """pytree takes an unregistered dataclass for one leaf: its tensors are opened by field, so a
    training step backpropagates through them (a prediction has its backward and optimizer step)
    and a numerics check compares them."""
    x = torch.randn(4, 8)
    prediction = fxdream.simulate(DataclassOut(), (x,), device="h100", training=True, optimizer="adam")
    assert {"fw", "bw", "optim"} <= {t.phase for t in prediction.task_graph.tasks}
    model = DataclassOut()
    optimized = fxdream.optimize(model, (x,), training=True, cost=None)
    assert optimized.report.graphs[0].backward_ops
    out, expected = optimized(x), model(x)
    assert type(out) is LogitsAndFeatures
    (out.logits.sum() + out.features.sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    (expected.logits.sum() + expected.features.sum()).backward()
    for got, want in zip(grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, want)
    changed = copy.deepcopy(model)
    with torch.no_grad():
        changed.head.bias += 1.0  # only the logits field differs
    assert max_abs_diff(model, changed, (x,), training=False) == pytest.approx(1.0)


@pytest.mark.parametrize("pre", [False, True])
def test_a_model_with_forward_hooks_is_not_traced_and_its_hooks_run_at_every_call(pre):
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()
    seen = []
    if pre:
        model[1].register_forward_pre_hook(lambda m, args: seen.append(args[0].shape) or None)
    else:
        model[1].register_forward_hook(lambda m, args, out: seen.append(out.shape) or None)
    x = torch.randn(4, 8)
    optimized = fxdream.optimize(model, (x,))
    assert "forward hooks on 1" in optimized.report.capture
    seen.clear()
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))
        optimized(x)
    assert len(seen) == 3  # eager's call and the module's two


class ScaledBy(nn.Module):
    def forward(self, x, scale, shift=None):
        return x * scale + (0 if shift is None else shift)


def test_a_non_tensor_example_input_is_named_by_position_and_value_in_the_capture_reason():
    model, x = ScaledBy(), torch.randn(3)
    optimized = fxdream.optimize(model.eval(), (x, 2.0, None), cost=None)
    assert optimized.report.capture == "dynamo (a non-tensor example input (scale=2.0, at position 1 and 1 more))"
    with torch.no_grad():
        torch.testing.assert_close(optimized(x, 2.0, None), x * 2)
    only_shift = fxdream.optimize(model.eval(), (x, torch.tensor(2.0), None), cost=None)
    assert only_shift.report.capture == "dynamo (a non-tensor example input (shift=None, at position 2 (its default)))"


def test_a_forward_hook_added_after_the_build_runs_and_leaves_with_its_removal():
    model, x = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), torch.randn(4, 8)
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture == "torch.fx symbolic_trace"
    for register in (model[0].register_forward_hook, model[2].register_forward_pre_hook):
        handle = register(lambda module, args, *output: (output[0] if output else args[0]) * 2)
        with torch.no_grad():
            torch.testing.assert_close(optimized(x), model(x))
        handle.remove()
    calls = []
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, output: calls.append(module))
    with torch.no_grad():
        optimized(x)
    handle.remove()
    assert all(any(m is module for m in calls) for module in model.modules())  # a global one runs too
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))


class EmbeddingLSTM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lstm, self.fc = nn.Embedding(50, 8), nn.LSTM(8, 12, batch_first=True), nn.Linear(12, 3)

    def forward(self, tokens):
        out, _ = self.lstm(self.emb(tokens))
        return self.fc(out[:, -1])


def test_another_batch_is_compiled_from_the_same_trace_where_dynamo_would_run_the_model_eagerly():
    torch.manual_seed(0)
    model = EmbeddingLSTM().eval()
    optimized = _eval_optimize(model, torch.randint(0, 50, (4, 6)))
    assert optimized.report.capture == "torch.fx symbolic_trace"
    for batch in (2, 3, 2):
        tokens = torch.randint(0, 50, (batch, 6))
        with torch.no_grad():
            torch.testing.assert_close(optimized(tokens), model(tokens))
    assert len(optimized.report.graphs) == 3  # one per input shape, each through the passes


class OptionalExtras(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, extra=None):
        return self.fc(x) if extra is None else self.fc(x) + sum(extra)


def test_a_list_argument_the_trace_never_took_goes_to_dynamo():
    model, x = OptionalExtras().eval(), torch.randn(4, 8)
    optimized = _eval_optimize(model, x)
    extra = [torch.randn(8), torch.randn(8)]
    with torch.no_grad():
        torch.testing.assert_close(optimized(x, extra=extra), model(x, extra=extra))
        torch.testing.assert_close(optimized(x, extra), model(x, extra))
    assert optimized.report.fallback_reason is None


class Accumulates(nn.Module):
    """A tensor made in forward and updated in place: torch.fx keeps it as one constant."""
    def forward(self, x):
        acc = torch.zeros(8)
        acc += x.sum(0)
        return acc * 2


def test_a_tensor_the_forward_makes_and_updates_in_place_sends_the_model_to_dynamo():
    model, x = Accumulates(), torch.randn(4, 8)
    optimized = _eval_optimize(model, x)
    assert optimized.report.capture == ("dynamo (forward updates a tensor it makes in place (_tensor_constant0: a "
                                        "trace keeps one such tensor across calls))")
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(optimized(x), model(x))
