"""torch's own module tests (``module_db``): the first sample of every module, built by
``optimize`` with its keyword inputs given as keywords, equals eager in inference and training
(outputs, and in training every parameter's gradient): ~230 small builds, ~25 s."""
import pytest
import torch
import torch.utils._pytree as pytree

import fxdream

common_modules = pytest.importorskip("torch.testing._internal.common_modules",
                                     reason="module_db needs torch's test utilities (and expecttest)")

MODULES = [info for info in common_modules.module_db]


def _first_sample(info, training: bool):
    samples = info.module_inputs_func(info, device="cpu", dtype=torch.float32, requires_grad=training,
                                      training=training)
    return samples[0] if samples else None


def _detached(value):
    return pytree.tree_map(lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t, value)


def _run(module, sample, training: bool):
    """(outputs, parameter gradients) of one call: in training, the backward of the outputs' sum."""
    args, kwargs = _detached(sample.forward_input.args), _detached(sample.forward_input.kwargs)
    for p in module.parameters():
        p.grad = None
    with torch.set_grad_enabled(training):
        torch.manual_seed(0)
        out = module(*args, **kwargs)
    leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    grads = []
    if training and any(t.requires_grad for t in leaves):
        sum(t.float().sum() for t in leaves if t.requires_grad).backward()
        grads = [None if p.grad is None else p.grad.clone() for p in module.parameters()]
    return _detached(out), grads


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("info", MODULES, ids=[info.name for info in MODULES])
def test_first_sample_equals_eager(info, training):
    sample = _first_sample(info, training)
    if sample is None:
        pytest.skip("no sample")
    torch.manual_seed(0)
    module = info.module_cls(*sample.constructor_input.args, **sample.constructor_input.kwargs).train(training)
    try:
        expected = _run(module, sample, training)
    except Exception as error:  # e.g. a constructor argument in float64 beside float32 inputs
        pytest.skip(f"the sample does not run eagerly in float32: {type(error).__name__}: {error}")
    args, kwargs = _detached(sample.forward_input.args), _detached(sample.forward_input.kwargs)
    optimized = fxdream.optimize(module, args, example_kwargs=kwargs, training=training, cost=None)
    actual = _run(optimized, sample, training)
    torch.testing.assert_close(actual[0], expected[0], equal_nan=True, msg=lambda m: f"outputs: {m}")
    for got, want in zip(actual[1], expected[1]):
        if want is not None:
            torch.testing.assert_close(got, want, equal_nan=True, msg=lambda m: f"gradients: {m}")
