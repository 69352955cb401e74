"""Keyword inputs, as torch.export takes them: ``example_kwargs`` in optimize, capture and
simulate, and an optimized module called by keyword as the model is."""
import functools
import inspect

import pytest
import torch
import torch.nn as nn
import torch.utils._pytree as pytree

import fxdream
from fxdream.ab import user_build
from fxdream.capturing.arguments import check_inputs, keyword_split, positional_call
from fxdream.ir.nodes import LAYER


class Masked(nn.Module):
    """A forward whose optional arguments sit between the ones a caller gives by keyword."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask=None, scale: float = 2.0, bias=None):
        y = self.proj(x) * scale
        if mask is not None:
            y = y.masked_fill(~mask, 0.0)
        if bias is not None:
            y = y + bias
        return y.relu()


def _inputs():
    torch.manual_seed(0)
    return torch.randn(2, 8), torch.rand(2, 8) > 0.5, torch.randn(8)


def test_keywords_take_their_parameters_places_and_the_defaults_fill_the_gaps():
    def forward(x, mask=None, scale=2.0, bias=None):
        pass
    assert positional_call(forward, (1,), {"bias": 5}) == (1, None, 2.0, 5)
    assert positional_call(forward, (), {"x": 1, "scale": 3.0}) == (1, None, 3.0)
    assert positional_call(forward, (1, 2), {}) == (1, 2)


def test_a_keyword_forward_does_not_place_is_refused_with_the_ones_it_does():
    def forward(x, mask=None, *, flag=False, **extra):
        pass
    with pytest.raises(TypeError, match=r"'flag' are not positional parameters of forward \(x, mask\)"):
        positional_call(forward, (1,), {"flag": True})
    with pytest.raises(TypeError, match="multiple values for argument 'x'"):
        positional_call(forward, (1,), {"x": 2})
    with pytest.raises(TypeError, match="'x' has no default and no example value"):
        positional_call(forward, (), {"mask": 2})


def test_example_kwargs_must_be_a_dict_and_a_dict_as_inputs_says_where_keywords_go():
    model = Masked()
    with pytest.raises(TypeError, match="example_kwargs must be a dict"):
        check_inputs((torch.randn(2, 8),), [("mask", None)], model)
    with pytest.raises(TypeError, match=r"give keyword arguments as example_kwargs=\{\.\.\.\}"):
        fxdream.optimize(model, {"x": torch.randn(2, 8)})


@pytest.mark.parametrize("training", [False, True])
def test_optimize_with_keyword_inputs_equals_eager_called_either_way(training):
    x, mask, bias = _inputs()
    model = Masked().train(training)
    optimized = fxdream.optimize(model, (x,), example_kwargs={"mask": mask, "bias": bias}, training=training,
                                 cost=None)
    assert optimized.report.fallback_reason is None
    with torch.set_grad_enabled(training):
        expected = model(x, mask=mask, bias=bias)
        torch.testing.assert_close(optimized(x, mask=mask, bias=bias), expected, rtol=0, atol=0)
        torch.testing.assert_close(optimized(x, mask, 2.0, bias), expected, rtol=0, atol=0)
        torch.testing.assert_close(optimized(bias=bias, x=x, mask=mask), expected, rtol=0, atol=0)
    assert len(optimized.report.graphs) == 1  # the keyword calls are the call the capture saw


def test_a_module_given_its_input_by_keyword_as_module_db_does():
    linear = nn.Linear(4, 3).eval()
    x = torch.randn(5, 4)
    optimized = fxdream.optimize(linear, example_kwargs={"input": x}, cost=None)
    with torch.no_grad():
        torch.testing.assert_close(optimized(input=x), linear(input=x), rtol=0, atol=0)


def test_capture_and_simulate_take_keyword_inputs():
    x, mask, bias = _inputs()
    model = Masked().eval()
    captured = fxdream.capture(model, (x,), example_kwargs={"mask": mask, "bias": bias})
    assert any(str(n.target).startswith("aten.masked_fill") for n in captured.forward.graph.nodes)
    prediction = fxdream.simulate(model, example_kwargs={"x": x, "mask": mask}, device="h100", cost="analytic")
    assert prediction.time_ms > 0


def test_an_ab_build_may_return_keyword_inputs():
    x, mask, _ = _inputs()
    build = user_build(lambda batch: (Masked(), {"x": x[:batch], "mask": mask[:batch]}))
    model, inputs, _ = build(1)
    assert len(inputs) == 2 and torch.equal(inputs[1], mask[:1])


class _Output(dict):
    """An output container of the model's own (as Hugging Face's ``ModelOutput``)."""


pytree.register_pytree_node(_Output, lambda d: (list(d.values()), list(d)), lambda values, keys: _Output(zip(keys, values)))


class ReturnsItsOwnContainer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        y = self.proj(x)
        # a trace builds a plain dict where eager builds the model's container
        return {"y": y, "relu": y.relu()} if isinstance(x, torch.fx.Proxy) else _Output(y=y, relu=y.relu())


def test_a_trace_whose_output_differs_only_in_its_container_is_kept_and_returns_eagers():
    model, x = ReturnsItsOwnContainer().eval(), torch.randn(2, 4)
    optimized = fxdream.optimize(model, (x,), cost=None)
    assert optimized.report.capture == "torch.fx symbolic_trace"
    with torch.no_grad():
        out = optimized(x)
    assert type(out) is _Output and torch.equal(out["relu"], model(x)["relu"])


def test_hugging_face_classifier_with_labels_by_keyword_trains_equal_to_eager():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=32, max_position_embeddings=32)
    torch.manual_seed(0)
    model = transformers.BertForSequenceClassification(config).train()
    inputs = dict(input_ids=torch.randint(0, 50, (2, 8)), attention_mask=torch.ones(2, 8, dtype=torch.long),
                  labels=torch.tensor([0, 1]))
    optimized = fxdream.optimize(model, example_kwargs=inputs, training=True, cost=None)
    assert optimized.report.fallback_reason is None
    grads = []
    for module in (optimized, model):
        for p in model.parameters():
            p.grad = None
        torch.manual_seed(1)
        loss = module(**inputs).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0])
    for got, want in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(got, want)


class Flagged(nn.Module):
    """Flags reach forward by keyword only, or through **kwargs (as Hugging Face's
    ``output_hidden_states=True`` does)."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask=None, *, double: bool = False, **kwargs):
        y = self.proj(x) * (2.0 if double else 1.0)
        if mask is not None:
            y = y.masked_fill(~mask, 0.0)
        return (y, y.relu()) if kwargs.get("both") else y


def test_keywords_without_a_position_are_split_off():
    signature = inspect.signature(Flagged().forward)
    x, mask, _ = _inputs()
    assert keyword_split(signature, {"mask": mask, "double": True, "both": True, "other": x}) == (
        {"mask": mask}, {"double": True, "both": True, "other": x})
    with pytest.raises(TypeError, match=r"'flag' are not parameters of forward \(x, mask, scale, bias\)"):
        keyword_split(inspect.signature(Masked().forward), {"flag": True})


class KeywordOnlyTensors(nn.Module):
    """Tensors by keyword only (``forward(x, *, mask, scale)``), and one through ``**kwargs``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, *, mask, scale, **kwargs):
        y = self.proj(x).masked_fill(~mask, 0.0) * scale
        return y + kwargs["bias"] if "bias" in kwargs else y


@pytest.mark.parametrize("training", [False, True])
def test_tensors_given_by_keyword_only_are_inputs_of_the_capture(training):
    x, mask, _ = _inputs()
    scale, bias = torch.full((8,), 0.5), torch.randn(8)
    model = KeywordOnlyTensors().train(training)
    kwargs = {"mask": mask, "scale": scale, "bias": bias}
    optimized = fxdream.optimize(model, (x,), example_kwargs=kwargs, training=training, cost=None)
    assert optimized.report.fallback_reason is None and "mask=<tensor>, scale=<tensor>" in optimized.report.notes[0]
    assert len(optimized.report.graphs) == 1  # one graph: x and the three keyword tensors its inputs
    with torch.set_grad_enabled(training):
        got, want = optimized(x, **kwargs), model(x, **kwargs)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        other = {"mask": ~mask, "scale": scale * 2, "bias": bias}  # other values: the same build
        torch.testing.assert_close(optimized(x, **other), model(x, **other), rtol=0, atol=0)
        torch.testing.assert_close(optimized(x, mask=mask, scale=scale), model(x, mask=mask, scale=scale))  # eager
    prediction = fxdream.simulate(model, (x,), example_kwargs=kwargs, device="h100", training=training)
    assert prediction.time_ms > 0 and not prediction.notes


def test_flags_without_a_position_are_bound_and_a_call_without_them_runs_eagerly():
    x, mask, _ = _inputs()
    model = Flagged().eval()
    optimized = fxdream.optimize(model, (x,), example_kwargs={"mask": mask, "double": True, "both": True}, cost=None)
    report = optimized.report
    assert report.fallback_reason is None
    assert report.notes[0].startswith("built for calls with double=True, both=True (keywords Flagged.forward takes "
                                      "without a position")
    with torch.no_grad():
        for got, want in zip(optimized(x, mask=mask, double=True, both=True), model(x, mask, double=True, both=True)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        torch.testing.assert_close(optimized(x, mask=mask), model(x, mask))            # without them: eager
        torch.testing.assert_close(optimized(x, double=False), model(x, double=False))  # other values: eager
    assert list(optimized.model.state_dict()) == list(model.state_dict())  # saved as the model saves


def test_flags_bound_for_an_eval_model_keep_its_submodules_modes():
    """The wrapper binding the flags has the model's mode: an eval model with a submodule left in
    train mode on purpose (MC dropout) is not switched, nor said to have been in train mode."""
    x, mask, _ = _inputs()
    model = Flagged().eval()
    model.proj.train()
    report = fxdream.optimize(model, (x,), example_kwargs={"double": True}, cost=None).report
    assert not any("mode" in note for note in report.notes), report.notes
    assert not model.training and model.proj.training


class HoldsAModel(nn.Module):
    """A submodule named ``model``, as Hugging Face's LlamaForCausalLM has: its layers keep that name."""

    def __init__(self):
        super().__init__()
        self.model = Flagged()

    def forward(self, x, *, double: bool = False):
        return self.model(x, double=double)


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("make, layer", [(Flagged, "proj"), (HoldsAModel, "model.proj")])
def test_layers_built_with_flags_are_named_as_in_the_users_model(make, layer, training):
    """Flags without a position wrap the model as the submodule ``model`` of the module captured:
    the layer names are the user's model's, not the wrapper's."""
    x, _, _ = _inputs()
    captured = fxdream.capture(make().train(training), (x,), training=training, example_kwargs={"double": True})
    graphs = [captured.forward] + ([captured.backward] if training else [])
    layers = {n.meta[LAYER] for gm in graphs for n in gm.graph.nodes if n.op == "call_function"}
    assert layer in layers and not any(name.startswith("model.model") for name in layers), layers
    if make is Flagged:
        assert not any(name.startswith("model") for name in layers), layers


def test_simulate_and_capture_take_flags_without_a_position():
    x, mask, _ = _inputs()
    model = Flagged().eval()
    captured = fxdream.capture(model, (x,), example_kwargs={"double": True, "both": True})
    outputs = [n for n in captured.forward.graph.nodes if n.op == "output"][0].args[0]
    assert len(outputs) == 2  # the both=True branch was captured
    prediction = fxdream.simulate(model, (x,), example_kwargs={"mask": mask, "both": True}, device="h100")
    assert prediction.time_ms > 0


def test_a_module_built_with_flags_that_runs_eagerly_takes_its_calls_as_the_model_does():
    x, mask, _ = _inputs()
    model = Flagged().eval()
    optimized = fxdream.optimize(model, (x,), example_kwargs={"mask": mask, "both": True}, cost=None)
    optimized._fall_back("as if the graphs had failed on a later call")
    assert optimized.report.model == "Flagged"
    with torch.no_grad():
        for got, want in zip(optimized(x, mask=mask, both=True), model(x, mask=mask, both=True)):
            torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("training", [False, True])
def test_the_builds_checks_call_a_module_built_with_keyword_only_tensors_as_the_model(training):
    x, mask, _ = _inputs()
    kwargs = {"mask": mask, "scale": torch.full((8,), 0.5)}
    model = KeywordOnlyTensors().train(training)
    report = fxdream.optimize(model, (x,), example_kwargs=kwargs, training=training, passes="auto", verify=True,
                              measure=True, eager_check=True).report
    assert report.verified_max_abs_diff == 0.0 and report.measured_optimized_ms > 0
    assert report.fallback_reason is None or report.measured_eager_ms is not None  # the eager check ran


def test_an_ab_of_a_model_taking_keyword_only_tensors_runs():
    x, mask, _ = _inputs()
    build = lambda batch: (KeywordOnlyTensors(), {"x": x[:batch], "mask": mask[:batch],  # noqa: E731
                                                  "scale": torch.full((8,), 0.5)})
    result = fxdream.ab(build, ["prepack_linear"], [2], rounds=1, block=1, progress=False)
    assert result.rows[0].max_abs_diff < 1e-5


def _flag_from_config(forward):
    """A decorator as transformers writes one: a flag the caller did not give by keyword is added
    as a keyword from the model's config (it cannot see the parameter's position), so a call
    that gives it by position raises "got multiple values"."""
    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        kwargs.setdefault("double", self.double_by_default)
        return forward(self, *args, **kwargs)
    return wrapper


class Decorated(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj, self.double_by_default = nn.Linear(8, 8), True

    @_flag_from_config
    def forward(self, x, mask=None, double=None):
        y = self.proj(x).masked_fill(~mask, 0.0)
        return (2 * y if double else y).relu()


@pytest.mark.parametrize("passes", [(), "auto"])
def test_a_decorated_forward_keeps_the_keywords_it_was_given_as_keywords(passes):
    x, mask, _ = _inputs()
    model = Decorated().eval()
    with pytest.raises(TypeError, match="multiple values"):
        model(x, mask, False)  # its positional form, as a capture takes a call
    keywords = {"mask": mask, "double": False}
    fxdream.optimize(model, (x,), example_kwargs=keywords, passes=passes, eager_check=True, verify=True)
    module = fxdream.optimize(model, (x,), example_kwargs=keywords, passes=passes, eager_check=False)
    other = torch.randn(2, 8)
    with torch.no_grad():
        calls = module._calls[0]
        torch.testing.assert_close(module(other, mask=mask, double=False), model(other, mask=mask, double=False))
        assert module._calls[0] == calls + 1  # through the captured graph
        torch.testing.assert_close(module(other, mask=mask), model(other, mask=mask))  # another call: eagerly
        assert module._calls[0] == calls + 1
