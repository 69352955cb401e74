"""A step's measured peak memory (fxdream.memory_check) and the simulator's predicted peak beside it."""
import pytest
import torch

import fxdream
from fxdream import models
from fxdream.memory_check import allocated_peak_bytes_during, peak_bytes_during

MIB = 2**20


@pytest.mark.parametrize("measure", [peak_bytes_during, allocated_peak_bytes_during])
def test_the_peak_of_a_step_counts_what_is_alive_at_once(measure):
    x, w = torch.randn(256, 1024), torch.randn(1024, 1024)

    def step():  # each value 1 MiB: a and its relu alive together, then a freed before b
        a = x @ w
        r = a.relu()
        del a
        return r @ w
    step()
    assert measure(step) == 2 * MIB


def test_memory_alive_before_the_step_is_not_counted():
    kept = [torch.randn(1024, 256) for _ in range(4)]  # 4 MiB allocated before
    assert peak_bytes_during(lambda: kept[0].relu()) == MIB


@pytest.mark.parametrize("name", ["mnist_convnet", "resnet18"])
def test_an_inference_steps_predicted_peak_is_the_measured_one(name):
    model, inputs, _ = models.build(name, 2, tiny=True)
    model.eval()
    predicted = fxdream.simulate(model, inputs, device="cpu", cost="analytic")
    captured = fxdream.optimize(model, inputs, cost=None)

    def step():
        with torch.no_grad():
            captured(*inputs)
    step()
    measured = peak_bytes_during(step)
    assert predicted.peak_memory_bytes - predicted.static_bytes == pytest.approx(measured, rel=0.01)


def test_the_allocators_peak_sees_a_captured_training_steps_backward():
    """The op-level reading books the compiled backward's frees at its start and reads a
    captured training step low; the allocator's replay sees the backward's gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512))
    x, grad = torch.randn(64, 256), torch.ones(64, 512)
    captured = fxdream.optimize(model, (x,), training=True, cost=None)

    def step():
        captured(x).backward(grad)
    for _ in range(2):
        for p in model.parameters():
            p.grad = None
        step()
    gradients = sum(p.numel() * 4 for p in model.parameters())
    for p in model.parameters():
        p.grad = None
    allocated = allocated_peak_bytes_during(step)
    for p in model.parameters():
        p.grad = None
    assert allocated > peak_bytes_during(step) and allocated >= gradients
