"""A forward that rebinds its state (``self.state = h.detach()``, a buffer reassigned): fxdream's
torch.fx probes (the symbolic trace, the trace checked against eager on one sample) leave no
proxy and no one-sample state in the model, and the built module carries the state as eager."""
import copy

import pytest
import torch
import torch.nn as nn

import fxdream


class StateInAttribute(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.fc = nn.GRU(7, 12, batch_first=True), nn.Linear(12, 2)
        self.state = None

    def forward(self, x):
        out, h = self.rnn(x, self.state)
        self.state = h.detach()
        return self.fc(out)


class StateInBuffers(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.fc = nn.LSTM(7, 12, batch_first=True), nn.Linear(12, 2)
        self.register_buffer("h", torch.zeros(1, 4, 12))
        self.register_buffer("c", torch.zeros(1, 4, 12))

    def forward(self, x):
        out, (h, c) = self.rnn(x, (self.h, self.c))
        self.h, self.c = h.detach(), c.detach()
        return self.fc(out)


def _no_proxy_in(model):
    return not any(isinstance(value, torch.fx.Proxy) for m in model.modules()
                   for value in [*vars(m).values(), *m._buffers.values()])


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("cls", [StateInAttribute, StateInBuffers])
def test_a_forward_that_rebinds_its_state_builds_and_carries_it_as_eager(cls, training):
    torch.manual_seed(0)
    model = cls().train(training)
    xs = [torch.randn(4, 8, 7) for _ in range(4)]
    optimized = fxdream.optimize(model, (xs[0],), training=training, passes=[], eager_check=False, cost=None)
    assert _no_proxy_in(model)
    reference = copy.deepcopy(model)  # the state as the build left it
    for x in xs:
        with torch.set_grad_enabled(training):
            torch.testing.assert_close(optimized(x), reference(x))
    with torch.set_grad_enabled(training):
        model(xs[0])  # the model itself still runs


class ScaledByBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        return self.lin(x) * self.scale.exp()  # an op on a buffer before any input reaches it


def test_a_value_computed_from_a_buffer_follows_the_buffer_after_the_build():
    model, x = ScaledByBuffer().eval(), torch.randn(2, 4)
    optimized = fxdream.optimize(model, (x,), eager_check=False, cost=None)
    assert optimized.report.capture.startswith("torch.fx")
    with torch.no_grad():
        model.scale.fill_(2.0)
        torch.testing.assert_close(optimized(x), model(x))
        model.load_state_dict({**model.state_dict(), "scale": torch.full((4,), 3.0)})
        torch.testing.assert_close(optimized(x), model(x))


class StateCopiedInPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn, self.fc = nn.GRU(7, 12, batch_first=True), nn.Linear(12, 2)
        self.register_buffer("h", torch.zeros(1, 4, 12))

    def forward(self, x):
        out, h = self.rnn(x, self.h.clone())
        self.h.copy_(h.detach())
        return self.fc(out)


def test_a_state_buffer_updated_in_place_is_read_afresh_by_every_training_step():
    torch.manual_seed(0)
    model = StateCopiedInPlace().train()
    optimized = fxdream.optimize(model, (torch.randn(4, 8, 7),), training=True, passes=[], eager_check=False,
                                 cost=None)
    reference = copy.deepcopy(model)
    for _ in range(3):
        x = torch.randn(4, 8, 7)
        for module in (optimized, reference):
            module(x).pow(2).mean().backward()
        torch.testing.assert_close(model.h, reference.h)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
