"""An input only unused outputs reach gets no gradient in a captured training step, as in eager."""
import copy

import pytest
import torch
import torch.fx as fx

import fxdream
from fxdream.runtime.unused_outputs import UnusedOutputs, reached_returns


class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(8, 8)
        self.a = torch.nn.Linear(8, 2)
        self.b = torch.nn.Linear(8, 3)

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.a(h), self.b(h)


def _graph():
    def f(x, w_a, w_b, y):
        h = x.relu()
        return h * w_a, h + w_b, y.sum()
    return fx.symbolic_trace(f)


def test_reached_returns_follows_the_data_flow():
    assert reached_returns(_graph(), 3) == (frozenset({0, 1}), frozenset({0}), frozenset({1}), frozenset({2}))
    assert reached_returns(_graph(), 2) == (frozenset({0, 1}), frozenset({0}), frozenset({1}), frozenset())


def test_only_inputs_reaching_some_differentiable_outputs_are_watched():
    unused = UnusedOutputs()
    # output 2 carries no gradient; input 3 (y) reaches only it, input 0 (x) reaches both others
    unused.track(reached_returns(_graph(), 3), frozenset({0, 1}), requiring_gradients=frozenset({0, 1, 2, 3}))
    assert unused.partial == {1: frozenset({0}), 2: frozenset({1})}
    unused.track(reached_returns(_graph(), 3), frozenset({0, 1}), requiring_gradients=frozenset({0}))
    assert not unused.needed


def test_drop_takes_the_last_noted_call_once():
    unused = UnusedOutputs()
    unused.track(reached_returns(_graph(), 3), frozenset({0, 1}), requiring_gradients=frozenset({0, 1, 2}))
    unused.note((torch.ones(1), None, None))
    assert unused.drop(["gx", "gwa", "gwb", None]) == ["gx", "gwa", None, None]
    assert unused.drop(["gx", "gwa", "gwb", None]) == ["gx", "gwa", "gwb", None]  # no note: as given


def _same_parameters(model, eager):
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        torch.testing.assert_close(p, q, msg=name)


def test_heads_trained_in_turn_match_eager_under_adamw():
    torch.manual_seed(0)
    model, x = TwoHeads(), torch.randn(4, 8)
    eager = copy.deepcopy(model)
    fast = fxdream.optimize(model, (x,), training=True, cost=None)
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1, weight_decay=0.1) for m in (model, eager)]
    for step in range(4):
        for module, optimizer in zip((fast, eager), optimizers):
            optimizer.zero_grad(set_to_none=True)
            module(x)[step % 2].sum().backward()
        assert model.b.weight.grad is None if step % 2 == 0 else model.a.weight.grad is None
        _same_parameters(model, eager)
        for optimizer in optimizers:
            optimizer.step()
        _same_parameters(model, eager)


def test_two_calls_using_different_outputs_give_both_gradients():
    torch.manual_seed(0)
    model, x = TwoHeads(), torch.randn(4, 8)
    eager = copy.deepcopy(model)
    fast = fxdream.optimize(model, (x,), training=True, cost=None)
    for module in (fast, eager):
        (module(x)[0].sum() + module(2 * x)[1].sum()).backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("output", [0, 1])
def test_attention_weights_alone_leave_the_output_projection_without_gradient(output):
    torch.manual_seed(0)
    attention, q = torch.nn.MultiheadAttention(8, 2, batch_first=True), torch.randn(2, 5, 8)
    eager = copy.deepcopy(attention)
    fast = fxdream.optimize(attention, (q, q, q), training=True, cost=None)
    fast(q, q, q)[output].sum().backward()
    eager(q, q, q)[output].sum().backward()
    for (name, p), e in zip(attention.named_parameters(), eager.parameters()):
        assert (p.grad is None) == (e.grad is None), name
        if p.grad is not None:
            torch.testing.assert_close(p.grad, e.grad, msg=name)
