"""What a build leaves as it was (RNG, statistics, grads, modes), copies, pickling, and the
known causes of a verified difference."""
import copy
import warnings

import pytest
import torch
import torch.nn as nn

import fxdream
from fxdream.capturing.model_state import StateSamples
from conftest import assert_same_training_step
from test_optimize import Small


@pytest.mark.parametrize("training", [False, True])
def test_optimize_leaves_the_users_rng_bn_statistics_and_grads_as_they_were(training):
    """Profiling draws random inputs and verify/eager_check run steps: none of it may show."""
    model = Small().train(training)
    x = torch.randn(2, 3, 8, 8)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(1234)
    expected_next = torch.rand(3)
    torch.manual_seed(1234)
    fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"], training=training, verify=True,
                     eager_check=True)
    assert torch.equal(torch.rand(3), expected_next)
    for k, v in model.state_dict().items():
        assert torch.equal(v, state[k]), k
    assert all(p.grad is None for p in model.parameters())


def _frozen_bn(model):
    """Fine-tuning with a frozen BatchNorm: the model trains, its BN uses and keeps running stats."""
    model.train()
    model.bn.eval()
    for p in model.bn.parameters():
        p.requires_grad_(False)
    with torch.no_grad():
        model.bn.running_mean.uniform_(-1, 1)
        model.bn.running_var.uniform_(0.5, 2)
    return model


@pytest.mark.parametrize("passes", [[], "auto"])
def test_a_training_build_keeps_a_frozen_batch_norm_in_eval(passes):
    torch.manual_seed(0)
    model, x = _frozen_bn(Small()), torch.randn(4, 3, 8, 8)
    reference = _frozen_bn(Small())
    reference.load_state_dict(model.state_dict())
    optimized = fxdream.optimize(model, (x,), passes=passes, training=True, eager_check=False)
    assert model.training and not model.bn.training  # as the user left them
    assert not any("mode" in note for note in optimized.report.notes)
    assert_same_training_step(reference, optimized, (x,))
    torch.testing.assert_close(model.bn.running_mean, reference.bn.running_mean, rtol=0, atol=0)


def test_an_inference_build_keeps_dropout_left_on_in_an_eval_model():
    # MC dropout: model.eval() with its dropout switched back on; the build must not switch it off
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.5), nn.Linear(32, 2)).eval()
    model[2].train()
    x = torch.randn(4, 8)
    optimized = fxdream.optimize(model, (x,), eager_check=False)
    assert not model.training and model[2].training
    with torch.no_grad():
        samples = torch.stack([optimized(x) for _ in range(8)])
    assert samples.std(0).max() > 0  # dropout draws a new mask every call


@pytest.mark.parametrize("training", [False, True])
def test_a_model_in_the_other_mode_is_switched_whole_and_the_report_says_so(training):
    model, x = Small().train(not training), torch.randn(2, 3, 8, 8)
    model.bn.train(training)  # a submodule already in the build's mode: switched with the rest
    optimized = fxdream.optimize(model, (x,), training=training, eager_check=False)
    assert all(m.training == training for m in model.modules())
    mode = "train" if training else "eval"
    assert optimized.report.notes[0] == (
        f"Small was in {'eval' if training else 'train'} mode: the {'training' if training else 'inference'} "
        f"build switched it and every submodule to {mode} mode (model.train({training})); it stays in that mode")


def test_capture_leaves_every_submodules_mode_as_it_was():
    model = _frozen_bn(Small())
    fxdream.capture(model, (torch.randn(2, 3, 8, 8),), training=False)  # switched during the capture only
    assert model.training and not model.bn.training and model.conv.training


@pytest.mark.parametrize("training, passes", [(False, []), (False, ["fuse_conv_bias_act"]), (True, [])])
def test_a_deep_copy_is_built_again_for_a_copy_of_the_model(training, passes):
    # the graphs run on the model's own tensors (and on oneDNN-packed weights, which cannot be
    # copied): a copy must run on its own model's weights, not the original's
    torch.manual_seed(0)
    model, x = Small().train(training), torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,), passes=passes, training=training, eager_check=False)
    copied = copy.deepcopy(optimized)
    applied = lambda m: [(row.name, row.applied) for row in m.report.passes]  # noqa: E731
    assert copied.model is not model and applied(copied) == applied(optimized)
    with torch.no_grad():
        copied.model.fc.bias.add_(1.0)  # only the copy's model changes
    with torch.set_grad_enabled(training):
        torch.testing.assert_close(optimized(x), model(x))
        torch.testing.assert_close(copied(x), copied.model(x))
        assert not torch.allclose(copied(x), optimized(x))


@pytest.mark.parametrize("training", [True, False])
def test_a_deep_copy_keeps_the_modes_set_after_the_build(training):
    """``best = copy.deepcopy(fast)`` after ``fast.eval()`` (or ``fast.train()`` for MC dropout)
    is a copy in that mode, as a copy of the model is, not in the build's."""
    torch.manual_seed(0)
    model, x = Small().train(training), torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,), training=training, eager_check=False)
    optimized.train(not training)
    copied = copy.deepcopy(optimized)
    assert [m.training for m in copied.modules()] == [m.training for m in optimized.modules()]
    assert all(m.training == (not training) for m in copied.model.modules())
    reference = copy.deepcopy(model)
    with torch.no_grad():
        torch.testing.assert_close(copied(x), reference(x))
    assert any("copy.deepcopy" in note for note in copied.report.notes)


class PaddedEncoder(nn.Module):
    def __init__(self):
        super().__init__()
        layer = nn.TransformerEncoderLayer(d_model=16, nhead=2, dim_feedforward=32, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 1)

    def forward(self, x, mask):
        return self.enc(x, src_key_padding_mask=mask)


def test_a_verified_difference_beyond_rounding_is_flagged_with_its_known_cause():
    """Eager's TransformerEncoder fast path zeroes padded positions; graphs (torch.compile's too)
    take the standard path. Unpadded positions agree; the report says why the rest differs."""
    torch.manual_seed(0)
    model, x = PaddedEncoder().eval(), torch.randn(2, 6, 16)
    mask = torch.zeros(2, 6, dtype=torch.bool)
    mask[0, 4:] = True
    optimized = fxdream.optimize(model, (x, mask), verify=True, cost=None)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x, mask)[~mask], model(x, mask)[~mask], atol=1e-5, rtol=1e-4)
    text = optimized.report.to_markdown()
    assert optimized.report.verified_max_abs_diff > 1e-2 and "More than rounding" in text
    assert "eager-only fast path" in text
    close = fxdream.optimize(Small().eval(), (torch.randn(2, 3, 8, 8),), verify=True, cost=None)
    assert "More than rounding" not in close.report.to_markdown()


def test_pickling_says_what_to_save_instead():
    import io
    import pickle
    optimized = fxdream.optimize(Small().eval(), (torch.randn(2, 3, 8, 8),))
    for save in (pickle.dumps, lambda m: torch.save(m, io.BytesIO())):
        with pytest.raises(TypeError, match=r"cannot be pickled .*\(torch\.save\(optimized\.model\.state_dict\(\)\)\)"):
            save(optimized)


class MomentumEncoder(nn.Module):
    """MoCo's key encoder: forward moves it toward the query encoder, through ``.data``."""

    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(8, 4), nn.Linear(8, 4)
        for p in self.k.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        with torch.no_grad():
            for pq, pk in zip(self.q.parameters(), self.k.parameters()):
                pk.data.mul_(0.9).add_(pq.data, alpha=0.1)
        return (self.q(x) * self.k(x)).sum(-1)


@pytest.mark.parametrize("training", [False, True])
def test_a_forward_updating_parameters_through_data_keeps_updating_them(training):
    """A torch.fx trace runs such an update once, at trace time: the built module would never
    move the key encoder (its version counter does not say it, its values do)."""
    torch.manual_seed(0)
    model, x = MomentumEncoder().train(training), torch.randn(5, 8)
    optimized = fxdream.optimize(model, (x,), training=training, eager_check=False)
    assert not optimized.report.capture.startswith("torch.fx")
    assert any(note.startswith("forward updates parameters in place (k.weight, k.bias)")
               for note in optimized.report.notes)
    reference = copy.deepcopy(model)
    for _ in range(3):
        with torch.set_grad_enabled(training):
            torch.testing.assert_close(optimized(x), reference(x))
        torch.testing.assert_close(model.k.weight, reference.k.weight)


def test_state_samples_see_updates_through_data_and_take_nan_as_itself():
    model = nn.Linear(64, 64)
    with torch.no_grad():
        model.bias[3] = float("nan")
    samples = StateSamples.of(model)
    assert samples.changed() == []
    model.weight.data.mul_(0.5)  # a counter of its own: only the values say it
    assert samples.changed() == ["weight"]
    assert StateSamples.of(nn.Linear(4, 4, device="meta")).changed() == []


def test_a_model_that_updates_no_parameter_gets_no_note():
    model, x = Small().eval(), torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,), eager_check=False)
    assert not any("updates parameters" in note for note in optimized.report.notes)


@pytest.mark.parametrize("training", [False, True])
def test_the_built_modules_own_flag_is_the_models(training):
    optimized = fxdream.optimize(Small().train(not training), (torch.randn(2, 3, 8, 8),), training=training,
                                 cost=None)
    assert optimized.training == optimized.model.training == training


def test_an_input_gradient_asked_of_an_inference_build_is_warned_of_once():
    model, x = Small().eval(), torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,), cost=None)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")
        optimized(x.clone().requires_grad_(True))  # no gradient asked for: nothing said
    with pytest.warns(UserWarning, match="build with training=True, then call .eval"):
        out = optimized(x.clone().requires_grad_(True))
    assert not out.requires_grad
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        optimized(x.clone().requires_grad_(True))  # once


def test_notes_that_say_the_same_of_several_graphs_are_said_once():
    from fxdream.optimized_module import per_graph_notes_folded
    notes = ["graph 0: dropped 5 copies", "first look", "graph 1: dropped 5 copies", "graph 1: 3 values folded",
             "graph 4: dropped 5 copies"]
    assert per_graph_notes_folded(notes) == ("graphs 0, 1, 4: dropped 5 copies", "first look",
                                             "graph 1: 3 values folded")


class CountsItsCalls(nn.Module):
    """A forward that changes Python attributes: a counter the output reads, a list it appends to,
    a tensor it keeps (``self.last``, in autograd's graph in training)."""

    def __init__(self):
        super().__init__()
        self.linear, self.calls, self.history, self.last = nn.Linear(4, 4), 0, [], None

    def forward(self, x):
        self.calls += 1
        self.history.append(self.calls)
        self.last = self.linear(x)
        return self.last * self.calls


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("passes", [(), "auto"])
def test_a_build_leaves_the_python_attributes_a_forward_changes_as_they_were(training, passes):
    torch.manual_seed(0)
    model, x = CountsItsCalls().train(training), torch.randn(2, 4)
    history = model.history
    optimized = fxdream.optimize(model, (x,), passes=passes, training=training, verify=True)
    assert (model.calls, model.history, model.last) == (0, [], None) and model.history is history
    reference = copy.deepcopy(model)
    for _ in range(3):
        with torch.set_grad_enabled(training):
            torch.testing.assert_close(optimized(x), reference(x))
    assert model.calls == reference.calls == 3 and model.history == [1, 2, 3]


def test_a_prediction_leaves_the_python_attributes_a_forward_changes_and_the_rng_as_they_were():
    model, x = CountsItsCalls().train(), torch.randn(2, 4)
    rng = torch.get_rng_state()
    fxdream.simulate(model, (x,), device="cpu", training=True)  # ops timed alone on random data
    fxdream.simulate(model, (x,), device="h100", training=True)
    assert (model.calls, model.history, model.last) == (0, [], None)
    assert torch.equal(torch.get_rng_state(), rng)


@pytest.mark.parametrize("training,passes", [(False, ()), (False, ["fuse_conv_bias_act"]), (True, ()),
                                             (True, ["reinplace"])])
def test_the_models_parameters_can_be_swapped_after_a_build(training, passes):
    # the captures' fake modes held weak references to the parameters they converted, and
    # torch.utils.swap_tensors (load_state_dict, .to() under swap_module_params_on_conversion)
    # refuses a tensor something holds weakly
    torch.manual_seed(0)
    model, other, x = Small().train(training), Small().train(training), torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,), passes=passes, training=training, eager_check=False)
    swapping = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model.load_state_dict(other.state_dict())
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swapping)
    if training:
        assert_same_training_step(model, optimized, (x,))
    else:
        with torch.no_grad():
            torch.testing.assert_close(optimized(x), other(x))


def test_the_models_parameters_can_be_swapped_after_a_prediction():
    model, x = Small().train(), torch.randn(2, 3, 8, 8)
    fxdream.simulate(model, (x,), device="cpu", training=True)
    replacement = nn.Parameter(torch.zeros_like(model.fc.weight))
    torch.utils.swap_tensors(model.fc.weight, replacement)  # raises where a weak reference is held
    assert torch.equal(model.fc.weight, torch.zeros_like(model.fc.weight))


def test_a_cache_object_among_the_keywords_is_as_it_was_after_the_build():
    # a Hugging Face DynamicCache is no tensor: it stays a constant of the call, and each of the
    # build's runs appended to it (its layers rebind their keys and values)
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=100, n_positions=64, n_embd=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0)
    model, ids = transformers.GPT2LMHeadModel(config).eval(), torch.randint(1, 100, (2, 6))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    step = dict(input_ids=ids[:, -1:], attention_mask=torch.ones(2, 7, dtype=torch.long), use_cache=True)
    keys = [layer.keys for layer in cache.layers]
    optimized = fxdream.optimize(model, (), example_kwargs=dict(step, past_key_values=cache), eager_check=False)
    assert cache.get_seq_length() == 6 and all(layer.keys is k for layer, k in zip(cache.layers, keys))
    with torch.no_grad():
        expected = model(**step, past_key_values=copy.deepcopy(cache)).logits
    torch.testing.assert_close(optimized(**step, past_key_values=copy.deepcopy(cache)).logits, expected)


def test_every_timed_call_of_a_build_sees_the_examples_cache_object():
    # OPT takes its positions from the attention mask: a cache one token longer than the mask
    # says leaves the new token no position, and the call raises; the build's timing loops (host
    # gaps, the eager check, verify) called the model again and again on the cache they grew
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.OPTConfig(num_hidden_layers=2, hidden_size=32, ffn_dim=64, num_attention_heads=2,
                                    max_position_embeddings=64, word_embed_proj_dim=32, vocab_size=100)
    model, ids = transformers.OPTForCausalLM(config).eval(), torch.randint(1, 100, (2, 6))
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
    step = dict(input_ids=ids[:, -1:], attention_mask=torch.ones(2, 7, dtype=torch.long), use_cache=True)
    optimized = fxdream.optimize(model, (), example_kwargs=dict(step, past_key_values=cache), passes="auto",
                                 verify=True)
    assert cache.get_seq_length() == 6 and not optimized.report.verified_beyond_rounding
    with torch.no_grad():
        expected = model(**step, past_key_values=copy.deepcopy(cache)).logits
    torch.testing.assert_close(optimized(**step, past_key_values=copy.deepcopy(cache)).logits, expected)


class _ScriptedInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = torch.jit.script(nn.Sequential(nn.Linear(8, 8), nn.ReLU()))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.inner(x))


@pytest.mark.parametrize("training", [False, True])
def test_torchscript_models_run_as_they_are_with_the_reason(training):
    torch.manual_seed(0)
    x = torch.randn(3, 8)
    plain = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).train(training)
    for model in (torch.jit.script(plain), torch.jit.trace(plain, (x,))):
        built = fxdream.optimize(model, (x,), training=training)
        assert built.report.fallback_reason.startswith("the model is a TorchScript module")
        torch.testing.assert_close(built(x), model(x))
    model = _ScriptedInside().train(training)  # a TorchScript submodule: dynamo's break there
    built = fxdream.optimize(model, (x,), training=training)
    assert any("TorchScript" in why for why in (built.report.fallback_reason or "", *built.report.graph_breaks))
    torch.testing.assert_close(built(x), model(x))
    with pytest.raises(fxdream.CaptureError, match="TorchScript module"):
        fxdream.optimize(torch.jit.script(plain), (x,), training=training, strict=True)


@pytest.mark.parametrize("mode", ["train", "eval"])
def test_a_backward_the_user_recorded_before_a_prediction_or_build_still_runs(mode):
    """BatchNorm saves its running statistics for backward; the throw-away steps update them and
    the build puts them back: their values and version counters must be as the graph saved them."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU()).train(mode == "train")
    x = torch.randn(2, 2, 6, 6)
    for act in (lambda: fxdream.simulate(model, (x,), device="cpu", cost="profiled", training=True),
                lambda: fxdream.optimize(model, (x,), training=True)):
        y = model(x)
        stats = model[1].running_mean.clone()
        act()
        assert torch.equal(model[1].running_mean, stats)
        y.sum().backward()  # raised "modified by an inplace operation"
