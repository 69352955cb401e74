import pytest
import torch
import torch.nn as nn

import fxdream
from fxdream.optimized_module import held_tensors
from conftest import assert_same_training_step


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        return self.fc(y.mean((2, 3)))


class ItemBreak(nn.Module):
    """``.item()`` forces a host sync: dynamo breaks the graph there."""
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        scale = y.abs().max().item()
        return self.b(y / (1.0 + scale))


@torch.library.custom_op("fxdream_test::opaque", mutates_args=())
def opaque(x: torch.Tensor) -> torch.Tensor:
    """A custom op with no fake kernel: dynamo cannot trace through it."""
    return x * 2


class Untraceable(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return opaque(self.lin(x))


def test_inference_output_equals_eager_and_report_is_filled():
    model, x = Small(), torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,))
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))
    report = optimized.report
    assert not report.training and report.device == "cpu"
    assert len(report.graphs) == 1 and report.graphs[0].backward_ops is None
    assert report.graphs[0].input_shapes == ((2, 3, 8, 8),)
    assert report.fallback_reason is None and report.graph_breaks == ()
    assert '"graphs"' in report.to_json() and "| subgraph |" in report.to_markdown()
    with pytest.raises(Exception):
        report.training = True  # frozen


def test_training_outputs_and_all_gradients_equal_eager():
    model, x = Small(), torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,), training=True)
    assert optimized.report.graphs[0].backward_ops > 0
    assert assert_same_training_step(model, optimized, (x,)) == len(list(model.parameters()))


def test_optimize_does_not_step_the_model_while_capturing():
    model, x = Small(), torch.randn(2, 3, 8, 8)
    stats = model.bn.running_mean.clone()
    fxdream.optimize(model, (x,), training=True)
    assert torch.equal(model.bn.running_mean, stats)
    assert all(p.grad is None for p in model.parameters())


def test_graph_break_is_correct_and_reported():
    model, x = ItemBreak(), torch.randn(3, 4)
    optimized = fxdream.optimize(model, (x,), training=True)
    report = optimized.report
    assert len(report.graphs) == 2
    assert any("item" in reason.lower() for reason in report.graph_breaks), report.graph_breaks
    assert "Graph breaks (1)" in report.to_markdown()
    assert_same_training_step(model, optimized, (x,))


def test_untraceable_model_runs_eagerly_with_the_reason():
    model, x = Untraceable(), torch.randn(2, 4)
    optimized = fxdream.optimize(model, (x,))
    report = optimized.report
    assert report.ran_eagerly
    assert "no fake impl" in report.fallback_reason and "opaque" in report.fallback_reason
    assert report.fallback_reason.startswith(f"the model's capture ({report.capture}) failed")  # which path
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))


def test_strict_raises_instead_of_falling_back():
    with pytest.raises(fxdream.CaptureError, match="strict=True: capture of Untraceable failed"):
        fxdream.optimize(Untraceable(), (torch.randn(2, 4),), strict=True)
    with pytest.raises(fxdream.CaptureError, match="not captured whole: graph breaks"):
        fxdream.optimize(ItemBreak(), (torch.randn(3, 4),), strict=True)


def test_new_input_shape_recaptures_and_stays_correct():
    model = Small()
    optimized = fxdream.optimize(model, (torch.randn(2, 3, 8, 8),))
    bigger = torch.randn(5, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(optimized(bigger), model(bigger))
    assert [g.input_shapes for g in optimized.report.graphs] == [((2, 3, 8, 8),), ((5, 3, 16, 16),)]


def test_a_wrong_call_raises_eagers_error_and_the_graphs_stay():
    """Dynamo fails to compile a call eager rejects too: that is the caller's error, not a reason
    to run eagerly from then on."""
    model = Small()
    optimized = fxdream.optimize(model, (torch.randn(2, 3, 8, 8),))
    with torch.no_grad(), pytest.raises(RuntimeError) as raised:
        optimized(torch.randn(2, 4, 8, 8))  # 4 channels where the conv takes 3
    with pytest.raises(RuntimeError) as eager:
        model(torch.randn(2, 4, 8, 8))
    assert str(raised.value) == str(eager.value)
    assert optimized.report.fallback_reason is None
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))
    assert len(optimized.report.graphs) == 1


class CountsCalls(Small):
    """A Python int the forward increments: dynamo guards on it and compiles every call again."""
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return super().forward(x)


@pytest.mark.parametrize("training", [False, True])
def test_a_model_dynamo_compiles_on_every_call_runs_eagerly_with_the_reason(training):
    torch.manual_seed(0)
    model, x = CountsCalls().train(training), torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"], training=training)
    for _ in range(6):
        with torch.set_grad_enabled(training):
            torch.testing.assert_close(optimized(x), Small.forward(model, x))
    report = optimized.report
    assert report.ran_eagerly and "compiled calls with the same input shapes 3 times" in report.fallback_reason
    # the build's own compilations, then three in a row: not one per call (up to dynamo's limit of 64)
    assert len(report.graphs) <= 5
    assert model.calls == 6  # the user's calls: the build's were undone


def test_layers_unfrozen_calls_apart_recompile_without_sending_the_module_to_eager():
    """Gradual unfreezing: each layer unfrozen is one compilation, calls apart, not a guard that
    changes on every call."""
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)), torch.randn(4, 8)
    model[0].requires_grad_(False)
    model[2].requires_grad_(False)
    optimized = fxdream.optimize(model, (x,), training=True, cost=None)
    for layer in (None, 2, 0):
        if layer is not None:
            model[layer].requires_grad_(True)
        for _ in range(3):
            assert_same_training_step(model, optimized, (x,))
    assert optimized.report.fallback_reason is None and len(optimized.report.graphs) == 3


def test_a_torch_module_dynamo_gave_up_on_does_not_leave_the_next_ones_uncaptured():
    """dynamo gives up on an nn.LSTM in training and marks the frame it entered, the wrapper every
    torch.nn module shares, to be skipped: the next torch.nn module built must still be captured."""
    lstm = fxdream.optimize(nn.LSTM(4, 4, batch_first=True), (torch.randn(2, 3, 4),), training=True, cost=None)
    assert lstm.report.ran_eagerly  # the RNN itself: dynamo does not trace it
    x = torch.randn(2, 3, 4)
    attention = fxdream.optimize(nn.MultiheadAttention(4, 2, batch_first=True).eval(), (x, x, x), cost=None)
    assert attention.report.graphs and not attention.report.ran_eagerly, attention.report.fallback_reason


def test_calls_in_other_layouts_and_by_keyword_are_not_a_recompile_storm():
    # dynamo guards strides: each layout compiles once, legitimately; a call by keyword is the
    # positional call the capture saw (positional_call), no new graph
    torch.manual_seed(0)
    model, x, wide = Small().eval(), torch.randn(2, 3, 8, 8), torch.randn(2, 3, 8, 16)
    optimized = fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"])  # forced: no eager check
    with torch.no_grad():
        for call in (lambda m: m(x=x), lambda m: m(x.to(memory_format=torch.channels_last)),
                     lambda m: m(wide[..., ::2]), lambda m: m(x)):
            torch.testing.assert_close(call(optimized), call(model))
    report = optimized.report
    assert not report.ran_eagerly, report.fallback_reason
    assert len(report.graphs) == 3


class DataDependentBranches(Small):
    """Each ``if`` on a tensor's value is a graph break: dynamo compiles the code after it once
    per branch, when a call first takes that branch."""
    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        y = y + 1 if x[:, 0].mean() > 0 else y - 1
        y = y * 2 if x[:, 1].mean() > 0 else y / 2
        y = y - 3 if x[:, 2].mean() > 0 else y + 3
        return self.fc(y.mean((2, 3)))


def test_branches_compiled_when_first_taken_are_not_a_recompile_storm():
    torch.manual_seed(0)
    model, x = DataDependentBranches().eval(), torch.randn(2, 3, 8, 8).abs()
    optimized = fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"])
    calls = [x]
    for channel in (2, 1, 0):  # each call takes one more branch the calls before did not
        flipped = calls[-1].clone()
        flipped[:, channel] *= -1
        calls.append(flipped)
    for call in calls + calls:
        with torch.no_grad():
            torch.testing.assert_close(optimized(call), model(call))
    report = optimized.report
    assert not report.ran_eagerly, report.fallback_reason
    assert len(report.graphs) >= 5  # the branches compiled one by one, each once


def test_new_shapes_compile_each_once_and_keep_the_graphs():
    optimized = fxdream.optimize(Small().eval(), (torch.randn(2, 3, 8, 8),))
    for batch in (3, 4, 5, 6, 3, 4):
        optimized(torch.randn(batch, 3, 8, 8))
    assert not optimized.report.ran_eagerly and len(optimized.report.graphs) == 5



class DoublesItsInput(Small):
    def forward(self, x):
        x.mul_(2)
        return super().forward(x)


@pytest.mark.parametrize("training", [False, True])
def test_the_example_input_a_forward_updates_in_place_comes_back_unchanged(training):
    torch.manual_seed(0)
    model, x = DoublesItsInput().train(training), torch.randn(2, 3, 8, 8)
    given = x.clone()
    optimized = fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"], training=training)
    assert torch.equal(x, given)  # the build ran the model several times
    if not training:  # the check of the trace against eager saw the same input twice
        assert optimized.report.capture == "torch.fx symbolic_trace"
    y, y_eager = x.clone(), x.clone()
    with torch.set_grad_enabled(training):
        torch.testing.assert_close(optimized(y), model(y_eager))
    assert torch.equal(y, y_eager) and torch.equal(y, 2 * x)  # each call updates its input, as eager


@pytest.mark.parametrize("device", ["cpu", "h100"])
@pytest.mark.parametrize("training", [False, True])
def test_a_prediction_gives_back_the_example_input_a_forward_updates_in_place(device, training):
    model, x = DoublesItsInput().train(training), torch.randn(2, 3, 8, 8)
    given = x.clone()
    fxdream.simulate(model, (x,), device=device, training=training)  # on the CPU: steps timed
    assert torch.equal(x, given)


@pytest.mark.parametrize("had_grad", [False, True])
def test_an_example_input_that_requires_grad_keeps_its_grad_through_a_training_build(had_grad):
    # the build's throw-away steps ran backward into it: x.grad came out set (or added to)
    model, x = Small(), torch.randn(2, 3, 8, 8, requires_grad=True)
    given = torch.ones_like(x) if had_grad else None
    x.grad = None if given is None else given.clone()
    before = x.grad
    fxdream.optimize(model, (x,), training=True, cost=None)
    assert x.grad is before and (given is None or torch.equal(x.grad, given))  # the same tensor, its values


def test_many_optimized_copies_of_one_class_are_each_captured():
    # every optimize() is its own dynamo backend; dynamo's default limit of 8 cache
    # entries per function would otherwise make later ones run eagerly without a word
    x = torch.randn(2, 3, 8, 8)
    for _ in range(10):
        optimized = fxdream.optimize(Small(), (x,))
        assert len(optimized.report.graphs) == 1 and not optimized.report.ran_eagerly


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(passes=["no_such_pass"]), ValueError, "unknown pass 'no_such_pass'; valid passes:"),
    (dict(passes=[42]), TypeError, "pass names or Pass objects"),
    (dict(device="tpu"), ValueError, "device='tpu' is not a device; valid here: cpu"),
    (dict(device="meta"), ValueError, "device='meta' is not supported; valid here: cpu"),
    (dict(device="cuda"), ValueError, "CUDA is not available on this machine; valid here: cpu"),
    (dict(training="yes"), TypeError, "training must be True or False"),
    (dict(memory_budget="1GB"), ValueError, "memory_budget must be None or a number of bytes ≥ 0"),
    (dict(memory_budget=-5), ValueError, "memory_budget must be None or a number of bytes ≥ 0"),
    (dict(cost="bogus"), ValueError, "cost='bogus' is not a cost model; valid: 'auto', 'profiled', 'analytic', None"),
])
def test_bad_arguments_get_one_clear_line(kwargs, error, message):
    if kwargs.get("device") == "cuda" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(error, match=message.replace("(", r"\(").replace(")", r"\)")):
        fxdream.optimize(Small(), (torch.randn(2, 3, 8, 8),), **kwargs)


def test_bad_model_and_inputs_are_named():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, got function"):
        fxdream.optimize(lambda x: x, (torch.randn(2),))
    with pytest.raises(TypeError, match=r"example_inputs\[1\] holds a object; expected torch.Tensors"):
        fxdream.optimize(Small(), (torch.randn(2, 3, 8, 8), [torch.randn(2), object()]))
    with pytest.raises(TypeError, match="example_inputs holds no torch.Tensor"):
        fxdream.optimize(Small(), (1, 2))
    with pytest.raises(TypeError, match="example_inputs must be a torch.Tensor or a tuple/list.*got dict: "
                                         "give keyword arguments as example_kwargs"):
        fxdream.optimize(Small(), {"x": torch.randn(2)})


class DictAndListInputs(nn.Module):
    """A batch as a dict and a list of differently sized images, plus a string option."""
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.lin = nn.Linear(4, 4)

    def forward(self, batch, extra, reduce="mean"):
        y = torch.relu(self.bn(self.conv(batch["image"]))).mean((2, 3)) + self.lin(batch["feats"])
        z = torch.stack([self.conv(im[None]).mean() for im in extra])
        return {"y": y, "z": z.sum() if reduce == "sum" else z.mean()}


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_nested_example_inputs_are_captured_and_equal_to_eager(training):
    torch.manual_seed(0)
    model = DictAndListInputs().train(training)
    inputs = ({"image": torch.randn(2, 3, 8, 8), "feats": torch.randn(2, 4)},
              [torch.randn(3, 6, 6), torch.randn(3, 9, 9)], "sum")
    optimized = fxdream.optimize(model, inputs, passes="auto", training=training, eager_check=False)
    assert optimized.report.graphs and not optimized.report.ran_eagerly
    if training:
        assert_same_training_step(model, optimized, inputs)
    else:
        with torch.no_grad():
            expected, actual = model(*inputs), optimized(*inputs)
        for key in expected:
            torch.testing.assert_close(actual[key], expected[key])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device to mismatch")
def test_inputs_on_another_device_are_named():
    with pytest.raises(ValueError, match=r"example_inputs\[0\] is on cuda"):
        fxdream.optimize(Small(), (torch.randn(2, 3, 8, 8, device="cuda"),))


class ArgMaxOnly(nn.Module):
    """Trained elsewhere (a loss on an auxiliary head, say): this output needs no gradient."""
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(x).argmax(-1)


def test_a_training_step_with_no_differentiable_output_is_built_verified_and_timed():
    model, x = ArgMaxOnly().train(), torch.randn(5, 4)
    optimized = fxdream.optimize(model, (x,), passes="auto", training=True, verify=True, measure=True,
                                 eager_check=True)
    report = optimized.report
    assert report.verified_max_abs_diff == 0.0
    assert report.measured_eager_ms > 0 and report.measured_optimized_ms > 0
    assert torch.equal(optimized(x), model(x))


def test_a_full_dynamo_cache_for_the_models_forward_is_cleared_and_said(monkeypatch):
    from fxdream.capturing import dynamo as dynamo_glue

    class Fresh(nn.Module):  # a class of its own: no cache entries from other tests
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            return torch.relu(self.lin(x))
    monkeypatch.setattr(dynamo_glue, "_recompile_limit", lambda: 2)  # dynamo's real limit: 64
    x = torch.randn(2, 4)
    notes = []
    for _ in range(3):
        optimized = fxdream.optimize(Fresh(), (x,), training=True, cost=None)
        assert optimized.report.graphs and not optimized.report.ran_eagerly
        notes.append(optimized.report.notes)
    assert notes[:2] == [(), ()]
    assert notes[2] == ("dynamo's cache for Fresh.forward was full (2 compilations earlier in this "
                        "process); cleared it to capture this one",)


class BreaksOnce(nn.Module):  # a class of its own: no cache entries from other tests
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        x = torch.relu(self.a(x))
        torch._dynamo.graph_break()
        return self.b(x)


def test_a_full_dynamo_cache_of_the_code_after_a_break_is_cleared_and_said(monkeypatch):
    """Each build compiles the function dynamo resumes at after the break once more: past the
    limit, later builds of the class would run that part eagerly."""
    from fxdream.capturing import dynamo as dynamo_glue
    monkeypatch.setattr(dynamo_glue, "_recompile_limit", lambda: 2)
    x = torch.randn(2, 4)
    for build in range(3):
        optimized = fxdream.optimize(BreaksOnce(), (x,), training=True, cost=None)
        assert len(optimized.report.graphs) == 2, build  # both sides of the break captured
    assert any(note.startswith("dynamo's cache for 1 function(s) resuming BreaksOnce.forward after a graph break "
                               "was full (2 compilations") for note in optimized.report.notes)


def test_a_full_dynamo_cache_shared_by_torchs_own_modules_is_cleared_and_said(monkeypatch):
    """dynamo compiles a torch.nn module (nn.Linear) through one wrapper frame all of them share:
    past the limit every later build of any of them would run eagerly."""
    from fxdream.capturing import dynamo as dynamo_glue
    monkeypatch.setattr(dynamo_glue, "_recompile_limit", lambda: 2)
    x = torch.randn(2, 4)
    notes = []
    for _ in range(3):
        optimized = fxdream.optimize(nn.Linear(4, 4), (x,), training=True, cost=None)
        assert optimized.report.graphs and not optimized.report.ran_eagerly
        notes.extend(optimized.report.notes)
    assert "dynamo's cache for Linear.forward (a frame every torch.nn module shares) was full (2 compilations " \
           "earlier in this process); cleared it to capture this one" in notes


class WithExtras(Small):
    """A model with what users read from it besides calling it: a config, a method."""
    def __init__(self):
        super().__init__()
        self.config = {"classes": 4}

    def predict_class(self, x):
        return self(x).argmax(-1)


def test_the_models_attributes_pass_through_as_under_torch_compile():
    model, x = WithExtras().eval(), torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,), cost=None)
    assert optimized.config is model.config and optimized.fc is model.fc
    with torch.no_grad():
        torch.testing.assert_close(optimized.predict_class(x), model(x).argmax(-1))
    assert optimized.report.model == "WithExtras"  # the module's own attributes come first
    with pytest.raises(AttributeError, match="'OptimizedModule' object has no attribute 'nothing', nor has the "
                                             "WithExtras it was built from"):
        optimized.nothing


class HoldsABuiltModule(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.inner, self.head = inner, nn.Linear(8, 4)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(x)))


@pytest.mark.parametrize("training", [False, True])
def test_a_model_holding_a_built_module_is_captured_with_it(training):
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    inner = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)).train(training)
    built_inner = fxdream.optimize(inner, (x,), training=training, cost=None)
    model = HoldsABuiltModule(built_inner).train(training)
    optimized = fxdream.optimize(model, (x,), training=training, cost=None)
    assert optimized.report.fallback_reason is None
    if training:
        assert_same_training_step(model, optimized, (x,))
    else:
        with torch.no_grad():
            torch.testing.assert_close(optimized(x), model(x))


class GrowingCache:
    """An object pytree does not open, holding a tensor that grows each step (a KV cache)."""
    def __init__(self, keys):
        self.layers = [{"keys": keys}]


class ReadsTheCache(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x, cache=None):
        return self.proj(x) if cache is None else self.proj(x) + cache.layers[0]["keys"].mean(1)


def test_a_cache_object_whose_tensors_grow_is_a_new_shape_each_step_not_a_recompile():
    torch.manual_seed(0)
    model, x = ReadsTheCache().eval(), torch.randn(2, 4)
    optimized = fxdream.optimize(model, (x,), cost=None)  # the prefill, without a cache
    for length in range(1, 8):
        cache = GrowingCache(torch.randn(2, length, 4))
        with torch.no_grad():
            torch.testing.assert_close(optimized(x, cache=cache), model(x, cache=cache))
    assert optimized.report.fallback_reason is None


class StepsThenKeys:
    def __init__(self, keys):
        self.steps = list(range(100_000))  # before the tensor, more values than a walk visits
        self.keys = keys


def test_held_tensors_reads_past_a_long_list_of_numbers():
    assert [tuple(t.shape) for t in held_tensors(StepsThenKeys(torch.zeros(2, 3, 4)))] == [(2, 3, 4)]
