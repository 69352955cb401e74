"""precision="bf16": CPU inference with convolutions and matrix products in bfloat16 (the bf16
pass), its deviation from float32 in the report, and where it declines."""
import pytest
import torch

import fxdream
from fxdream import models
from fxdream.numerics import Deviation, deviation
from fxdream.pass_registry import available_passes
from fxdream.sim.cost import devices

needs_bf16 = pytest.mark.skipif(not devices.native_bf16(), reason="this CPU has no native bf16")


class LinearSoftmaxLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.second(torch.softmax(self.first(x), dim=-1))


def _row(module, name="bf16"):
    return next(r for r in module.report.passes if r.name == name)


@needs_bf16
def test_matrix_products_run_in_bf16_the_ops_between_follow_and_the_output_is_float32():
    torch.manual_seed(0)
    model, x = LinearSoftmaxLinear().eval(), torch.randn(3, 8)
    module = fxdream.optimize(model, (x,), precision="bf16", cost=None)
    row = _row(module)
    # two addmm in bf16, the softmax between them too (its input is bf16); both weights and
    # biases made bf16 once; casts per call: the input to bf16, the output to float32
    assert row.applied and row.reason == "2 convolutions and matrix products in bf16; 4 weights made bf16 once, " \
                                         "2 casts per call"
    out = module(x)
    assert out.dtype == torch.float32
    with torch.no_grad():
        expected = model(x)
    assert not torch.equal(out, expected)  # it did compute in bf16
    torch.testing.assert_close(out, expected, atol=2e-2, rtol=2e-2)
    assert module.report.precision == "bf16"
    assert module.report.precision_deviation.max_abs == pytest.approx((out - expected).abs().max().item())
    assert "Precision bf16: measured against float32 eager" in module.report.to_markdown()


@needs_bf16
def test_a_conv_net_fuses_its_bf16_convolutions_and_keeps_its_classes():
    model, inputs, _ = models.build("resnet18", 2, tiny=True)
    model.eval()
    module = fxdream.optimize(model, inputs, passes="auto", precision="bf16", eager_check=False)
    applied = {r.name for r in module.report.passes if r.applied}
    assert {"bf16", "fuse_conv_bias_act"} <= applied
    found = module.report.precision_deviation
    assert found.argmax_agreement is not None and found.max_rel < 0.05
    with torch.no_grad():
        torch.testing.assert_close(module(*inputs), model(*inputs), atol=0.05, rtol=0.05)


def test_auto_never_picks_it_on_its_own():
    assert "bf16" not in available_passes()
    model, x = LinearSoftmaxLinear().eval(), torch.randn(3, 8)
    module = fxdream.optimize(model, (x,), passes="auto", eager_check=False)
    assert all(r.name != "bf16" for r in module.report.passes) and module.report.precision == "fp32"


def test_it_declines_with_the_reason_on_a_cpu_without_native_bf16(monkeypatch):
    monkeypatch.setattr(devices, "native_bf16", lambda: False)
    model, x = LinearSoftmaxLinear().eval(), torch.randn(3, 8)
    module = fxdream.optimize(model, (x,), precision="bf16", cost=None)
    assert not _row(module).applied and "no native bf16" in _row(module).reason
    assert module.report.precision == "fp32" and module.report.precision_deviation is None
    assert any("precision='bf16' was not applied" in n and "no native bf16" in n for n in module.report.notes)
    with torch.no_grad():
        assert torch.equal(module(x), model(x))
    double = fxdream.optimize(model.double(), (x.double(),), precision="bf16", cost=None)
    assert any("was not applied (the module computes in the model's own dtypes)" in n  # float64 here
               for n in double.report.notes)


def test_it_declines_in_training():
    model, x = LinearSoftmaxLinear(), torch.randn(3, 8)
    module = fxdream.optimize(model, (x,), training=True, precision="bf16", cost=None)
    assert not _row(module).applied and "inference" in _row(module).reason


def test_an_unknown_precision_is_refused():
    with pytest.raises(ValueError, match="precision='fp8' is not known; valid: fp32, bf16"):
        fxdream.optimize(LinearSoftmaxLinear().eval(), (torch.randn(3, 8),), precision="fp8")


def test_deviation_of_a_classifier_counts_the_rows_whose_top_class_moved():
    class Shifted(torch.nn.Module):
        def forward(self, x):
            return x + torch.tensor([[0.0, 0.0], [0.0, 2.0]])
    logits = torch.tensor([[2.0, 1.0], [1.0, 0.5]])
    found = deviation(torch.nn.Identity(), Shifted(), (logits,))
    # row 2 moves from class 0 to class 1; the largest |eager output| is 2.0
    assert found == Deviation(max_abs=2.0, max_rel=1.0, argmax_agreement=0.5)
    assert deviation(torch.nn.Identity(), torch.nn.Identity(), (torch.randn(4),)) == Deviation(0.0, 0.0, None)


@needs_bf16
def test_the_passes_after_it_rewrite_the_bf16_graph_attention_and_packed_linears():
    """BERT's float32 mask makes the scores float32 before the softmax (type promotion) and the
    bf16 pass casts the probabilities back for the second matmul: fuse_attention matches through
    that cast (giving SDPA the mask in bf16), and prepack_linear packs the bf16 weights."""
    model, inputs, _ = models.build("bert_base", 2, tiny=True)
    model.eval()
    module = fxdream.optimize(model, inputs, passes=["fuse_attention", "prepack_linear"], precision="bf16",
                              cost=None)
    assert _row(module, "fuse_attention").reason == "2 attention block(s) → scaled_dot_product_attention"
    assert _row(module, "prepack_linear").applied
    assert module.report.precision == "bf16" and module.report.precision_deviation.max_rel < 0.05
    with torch.no_grad():
        torch.testing.assert_close(module(*inputs), model(*inputs), atol=0.02, rtol=0.05)


class EmbedLstmHead(torch.nn.Module):
    """Token ids (a keyword) → embedding → LSTM → linear: the recurrent layer stays float32."""

    def __init__(self):
        super().__init__()
        self.embed, self.lstm, self.head = torch.nn.Embedding(50, 8), torch.nn.LSTM(8, 16, batch_first=True), \
            torch.nn.Linear(16, 4)

    def forward(self, ids=None):
        return self.head(self.lstm(self.embed(ids))[0])


@needs_bf16
def test_a_recurrent_layer_keeps_float32_between_bf16_ops():
    torch.manual_seed(0)
    model, ids = EmbedLstmHead().eval(), torch.randint(0, 50, (2, 5))
    module = fxdream.optimize(model, (), example_kwargs={"ids": ids}, precision="bf16", cost=None)
    assert _row(module).applied and module.report.precision == "bf16"
    with torch.no_grad():
        out, expected = module(ids=ids), model(ids=ids)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=0.02, rtol=0.05)


@needs_bf16
def test_a_graph_too_small_to_pay_for_its_casts_is_predicted_slower_and_the_report_says_so():
    torch.manual_seed(0)
    model, x = LinearSoftmaxLinear().eval(), torch.randn(3, 8)  # two tiny matmuls, two casts
    module = fxdream.optimize(model, (x,), precision="bf16", cost="analytic")
    row = _row(module)
    assert row.applied and row.predicted_delta_us > 0  # the casts' dispatch outweighs the 8x16 products
    assert any("predicted" in n and "slower per call than float32" in n for n in module.report.notes)


@needs_bf16
class AddsInPlace(torch.nn.Module):
    def forward(self, x):
        return x.add_(1)


class Noisy(torch.nn.Module):
    def forward(self, x):
        return torch.nn.functional.dropout(x, 0.5, training=True)


class Pair(torch.nn.Module):
    """A scalar first, then a classifier's logits; NaNs where the input is negative."""
    def forward(self, x):
        return x.mean(), torch.log(x)


class PairOfAbs(torch.nn.Module):
    def forward(self, x):
        return x.mean(), torch.log(x.abs())


def test_deviation_runs_each_side_on_its_own_inputs_from_one_rng_state_and_ignores_shared_nans():
    x = torch.tensor([[1.0, 2.0], [3.0, -1.0]])
    assert deviation(AddsInPlace(), AddsInPlace(), (x.clone(),)) == Deviation(0.0, 0.0, 1.0)
    assert deviation(Noisy(), Noisy(), (torch.randn(8, 4),)).max_abs == 0.0  # the same mask on both sides
    found = deviation(Pair(), Pair(), (x,))
    assert found == Deviation(0.0, 0.0, 1.0)  # the NaN of log(-1) on both sides; logits the second output
    assert deviation(PairOfAbs(), Pair(), (x,)).max_abs == float("inf")  # a NaN on one side only


@needs_bf16
def test_verify_does_not_call_bf16s_expected_deviation_a_wrong_result():
    torch.manual_seed(0)
    model, x = torch.nn.Linear(64, 64).eval(), 10 * torch.randn(4, 64)  # outputs ~30: bf16 errs by ~0.1
    module = fxdream.optimize(model, (x,), precision="bf16", cost=None, verify=True)
    assert module.report.verified_max_abs_diff > 1e-2 and not module.report.verified_beyond_rounding
    assert "More than rounding" not in module.report.to_markdown()


@needs_bf16
def test_a_new_batch_size_compiles_in_bf16_again():
    """The bf16 constants' fake values carry no size symbols: dynamo's guards for the graph of
    another batch size would find symbols without a source and fail, sending the module to eager
    float32 for good."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv1d(4, 8, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv1d(8, 4, 3, padding=1)).eval()
    module = fxdream.optimize(model, (torch.randn(2, 4, 16),), precision="bf16", cost=None)
    for batch in (5, 3, 2):
        x = torch.randn(batch, 4, 16)
        with torch.no_grad():
            difference = (module(x) - model(x)).abs().max().item()
        assert 0 < difference < 5e-2, batch  # bf16's rounding: neither float32 nor wrong
    assert not module.report.ran_eagerly and all(r.applied for r in module.report.passes if r.name == "bf16")


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.prelu = torch.nn.PReLU(8)

    def forward(self, x):
        y = self.prelu(self.conv(x))
        return y * 2 if x.sum() > 0 else y  # a data-dependent branch: dynamo captures it


@needs_bf16
def test_a_model_dynamo_captures_and_a_prelu_run_in_bf16():
    torch.manual_seed(0)
    model, x = Branchy().eval(), torch.randn(2, 3, 8, 8).abs()
    module = fxdream.optimize(model, (x,), precision="bf16", cost=None)
    assert module.report.capture.startswith("dynamo")
    assert _row(module).applied and _row(module).reason.startswith("1 convolutions and matrix products in bf16")
    assert module.report.precision_deviation is not None and module.report.precision_deviation.max_abs > 0


class EmbeddingHead(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding, self.head = torch.nn.Embedding(20, 8), torch.nn.Linear(8, 3)

    def forward(self, tokens):
        return self.head(self.embedding(tokens).mean(1))


@needs_bf16
def test_the_row_counts_embedding_lookups_apart_from_matrix_products():
    torch.manual_seed(0)
    module = fxdream.optimize(EmbeddingHead().eval(), (torch.randint(0, 20, (2, 5)),), precision="bf16", cost=None)
    assert _row(module).reason.startswith("1 convolutions and matrix products, 1 embedding lookups in bf16")
