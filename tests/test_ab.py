import json

import pytest
import torch
import torch.nn as nn

from fxdream.ab import ab, plot_ab
from fxdream.ir.nodes import op_name
from fxdream.pass_api import PassResult


class DoubleNeg(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.neg(torch.neg(self.lin(x))).relu()


class RemoveDoubleNeg:
    name = "test_remove_double_neg"

    def applies_to(self, ctx):
        return None if ctx.phase == "fw" else "forward only"

    def __call__(self, gm, ctx):
        removed = 0
        for node in list(gm.graph.nodes):
            inner = node.args[0] if node.args else None
            if op_name(node) == "aten.neg" and getattr(inner, "target", None) is node.target and len(inner.users) == 1:
                node.replace_all_uses_with(inner.args[0])
                gm.graph.erase_node(node)
                gm.graph.erase_node(inner)
                removed += 1
        return PassResult(gm, removed > 0, f"removed {removed} double negation(s)")


def build(batch):
    torch.manual_seed(0)
    model = DoubleNeg()
    x = torch.randn(batch, 16)
    return model, (x,), lambda out: out.sum()


def test_ab_rows_have_measured_and_predicted_columns_for_each_batch(tmp_path):
    result = ab(build, [RemoveDoubleNeg()], batch_sizes=(1, 4), rounds=1, block=2, progress=False)
    assert [r.batch for r in result.rows] == [1, 4]
    for row in result.rows:
        assert row.passes == ("test_remove_double_neg",)
        assert row.max_abs_diff == 0.0
        assert row.baseline.median_ms > 0 and row.optimized.median_ms > 0
        # two ops fewer in the simulated graph: the predicted optimized time is lower
        assert row.predicted_optimized_ms < row.predicted_baseline_ms
        assert row.predicted_delta_pct < 0
        assert any("removed 1 double negation" in reason for reason in row.pass_reasons)
    table = result.to_markdown()
    assert "predicted baseline ms" in table and "| DoubleNeg |" not in table
    data = json.loads(result.to_json())
    assert len(data["rows"]) == 2 and "error_pct" in data["rows"][0]
    plot_ab(result, tmp_path / "ab.png")
    assert (tmp_path / "ab.png").stat().st_size > 0


def test_ab_training_checks_gradients_too():
    (row,) = ab(build, [RemoveDoubleNeg()], batch_sizes=(2,), training=True, rounds=1, block=1,
                progress=False).rows
    assert row.training and row.max_abs_diff == 0.0
    assert any(reason.startswith("0/bw: not applied: forward only") for reason in row.pass_reasons)


def test_training_predictions_include_the_measured_host_gaps_and_inference_runs_without_grad():
    import fxdream
    from fxdream.ab import measured_step, step_fn
    from fxdream.build import cost_model_for
    model, inputs, loss_fn = build(2)
    cost = cost_model_for("cpu", "profiled")
    inference = fxdream.optimize(model.eval(), inputs)
    assert measured_step(inference, model, inputs, loss_fn, False, cost) is None  # one graph, no autograd
    assert not step_fn(model, inputs, loss_fn, False)().requires_grad  # eager timed under no_grad too
    training = fxdream.optimize(model.train(), inputs, training=True)
    step = measured_step(training, model, inputs, loss_fn, True, cost)
    assert step.calls == ("g0.fw", "g0.bw") and all(us >= 0 for us in step.gaps_us + (step.end_us,))
    assert all(p.grad is None for p in model.parameters())


def test_a_pass_that_changes_nothing_is_predicted_to_change_nothing_in_training():
    (row,) = ab(build, ["fuse_conv_bias_act"], batch_sizes=(2,), training=True, rounds=1, block=1,
                progress=False).rows
    assert not any(": applied:" in reason for reason in row.pass_reasons)
    assert row.predicted_delta_pct == 0.0  # one measured step serves both predictions


def test_predictions_use_costs_profiled_between_the_timed_blocks(monkeypatch):
    # the costs come from the same minutes as the measurements, not from the build's
    from fxdream.sim.cost.profiled import Profiled
    calls = []
    original = Profiled.profile_in_context

    def recording(self, captured, *args, again=False, **kwargs):
        calls.append(again)
        return original(self, captured, *args, again=again, **kwargs)
    monkeypatch.setattr(Profiled, "profile_in_context", recording)
    result = ab(build, [RemoveDoubleNeg()], batch_sizes=(2,), rounds=4, block=1, progress=False)
    assert calls.count(True) >= 4  # at least once per round (every call here: block=1)
    assert result.rows[0].predicted_at_build_ms is not None  # optimize()'s own, kept beside
    assert "at build: error" in result.to_markdown()


def _mlp(batch):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)), torch.randn(batch, 8)


@pytest.mark.parametrize("training", [False, True])
def test_a_build_function_may_leave_out_the_loss_as_on_the_command_line(training):
    for build in (_mlp, lambda batch: (*_mlp(batch), None)):
        (row,) = ab(build, ["reinplace"], batch_sizes=(2,), training=training, rounds=1, block=1,
                            progress=False).rows
        assert row.max_abs_diff == 0.0
    with pytest.raises(TypeError, match=r"must return \(model, inputs\) or \(model, inputs, loss_fn\), got tuple of 1"):
        ab(lambda batch: (_mlp(batch)[0],), ["reinplace"], progress=False)
    with pytest.raises(TypeError, match=r"with the model a torch.nn.Module, got a function first"):
        ab(lambda batch: (lambda x: x, torch.randn(batch, 8)), ["reinplace"], progress=False)


def test_a_module_with_its_example_inputs_is_measured_at_their_batch():
    model, x = _mlp(3)
    (row,) = ab(model, [RemoveDoubleNeg()], example_inputs=(x,), rounds=1, block=1, progress=False).rows
    assert (row.model, row.batch, row.max_abs_diff) == ("Sequential", 3, 0.0)
    model.eval()
    (row,) = ab(model, ["reinplace"], example_inputs=x, loss_fn=lambda out: out.square().sum(), training=True,
                batch_sizes=3, rounds=1, block=1, progress=False).rows
    assert row.training and row.max_abs_diff == 0.0
    assert not any(m.training for m in model.modules())  # the user's module left in its mode


@pytest.mark.parametrize("call, error, message", [
    (lambda m, x: ab(m, ["reinplace"], progress=False), TypeError,
     "ab got a Sequential without example_inputs: give the module's example_inputs"),
    (lambda m, x: ab(m, ["reinplace"], batch_sizes=(1, 8), example_inputs=(x,), progress=False), ValueError,
     r"batch_sizes=\(1, 8\): a module with its example_inputs is measured at their batch \(3\)"),
    (lambda m, x: ab(_mlp, ["reinplace"], example_inputs=(x,), progress=False), TypeError,
     "example_inputs and loss_fn are for a module given as the model"),
    (lambda m, x: ab(m, "", example_inputs=(x,), progress=False), ValueError,
     "passes='': an A/B compares the model with passes against it without"),
])
def test_a_module_without_its_example_inputs_or_with_other_batch_sizes_gets_one_line(call, error, message):
    with pytest.raises(error, match=message):
        call(*_mlp(3))


def test_auto_measures_the_subset_optimize_keeps_and_names_it():
    (row,) = ab(build, "auto", batch_sizes=(2,), rounds=1, block=1, progress=False).rows
    assert row.passes[0] == "auto" and row.max_abs_diff == 0.0
    assert not any("forced" in reason for reason in row.pass_reasons)  # chosen, not every pass forced
