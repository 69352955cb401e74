"""The training step a build times: the model's forward and backward, and no loss of fxdream's."""
import torch
from torch import nn

import fxdream
import fxdream.eager_check as eager_check
from fxdream.capturing.steps import LOSS_RANGE, one_step, seeded_step


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 3), nn.Linear(8, 2)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return {"a": self.a(h), "b": self.b(h), "count": 2}


def _grads(model, step) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    step()
    return [p.grad.clone() for p in model.parameters()]


def test_a_seeded_step_gives_the_gradients_of_one_step():
    model, x = TwoHeads(), torch.randn(4, 8)
    expected = _grads(model, lambda: one_step(model, (x,), True))
    step = seeded_step(model, (x,), True)
    for _ in range(2):  # the seeds made on the first step, then kept
        for got, want in zip(_grads(model, step), expected):
            torch.testing.assert_close(got, want)


def test_a_seeded_step_runs_no_loss_op_after_its_first():
    model, x = TwoHeads(), torch.randn(4, 8)
    step = seeded_step(model, (x,), True)
    with torch.profiler.profile() as first:
        step()
    with torch.profiler.profile() as later:
        step()
    with torch.profiler.profile() as scalar:
        one_step(model, (x,), True)
    names = [e.name for e in later.events()]
    assert "aten::ones_like" not in names and LOSS_RANGE not in names
    assert LOSS_RANGE in {e.name for e in first.events()}  # the seeds, made once inside the loss range
    # one_step sums each of the two outputs; the bias gradients' sums are the model's own
    sums = [e.name for e in scalar.events()].count("aten::sum")
    assert names.count("aten::sum") == sums - 2


def test_a_seeded_step_makes_new_seeds_when_the_outputs_shape_changes():
    model = TwoHeads()
    inputs = [torch.randn(4, 8)]
    step = seeded_step(lambda x: model(x), inputs, True)  # the list is read at each step
    step()
    inputs[0] = torch.randn(6, 8)
    model.zero_grad(set_to_none=True)
    step()
    assert model.a.bias.grad.tolist() == [6.0, 6.0, 6.0]  # d sum / d bias over 6 rows


def test_the_eager_check_times_seeded_steps_on_both_sides(monkeypatch):
    stepped = []

    def recording(call, inputs, training, before_each=None):
        stepped.append((call, training))
        return seeded_step(call, inputs, training, before_each)
    monkeypatch.setattr(eager_check, "seeded_step", recording)
    model = TwoHeads()
    built = fxdream.optimize(model, (torch.randn(4, 8),), training=True, eager_check=True, cost="profiled")
    assert stepped == [(model, True), (built, True)]


class CheckpointedDropout(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.drop = nn.Linear(8, 8), nn.Linear(8, 4), nn.Dropout(0.3)

    def forward(self, x):
        inner = lambda t: self.drop(torch.nn.functional.gelu(self.a(t)))  # noqa: E731
        return self.b(torch.utils.checkpoint.checkpoint(inner, x, use_reentrant=False))


def test_a_replayed_dropout_is_timed_alone_with_a_valid_generator_state(monkeypatch):
    # activation checkpointing replays dropout under run_with_rng_state(state, op, ...): synthetic
    # bytes are no generator state ("Invalid mt19937 state"), and the cost fell back to a guess
    from fxdream.sim.cost.analytic import Analytic
    from fxdream.sim.cost.devices import get_device
    from fxdream.sim.cost import profiled
    warned = []
    monkeypatch.setattr(profiled.log, "warning", lambda *args: warned.append(args))
    captured = fxdream.capture(CheckpointedDropout().train(), (torch.randn(4, 8),), training=True)
    replays = [n for n in captured.backward.graph.nodes if n.target is torch.ops.higher_order.run_with_rng_state]
    assert replays
    timed = profiled.Profiled(get_device("cpu")).kernel_us(replays[0])
    assert not warned and timed != Analytic(get_device("cpu")).kernel_us(replays[0])
