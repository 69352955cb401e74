"""Numerical equality of an optimized module against eager: outputs and gradients."""
from __future__ import annotations

import copy
import math

import torch
from torch.utils._pytree import tree_leaves


def _leaf_diff(actual, expected) -> float:
    """Max |actual - expected|; inf where the two are not alike (shape, or not both tensors):
    broadcasting would make a 0-d output against eager's (3, 4) read as a small difference."""
    if not isinstance(expected, torch.Tensor) or actual.shape != expected.shape:
        return math.inf
    return (actual.float() - expected.float()).abs().max().item()


def _default_loss(output) -> torch.Tensor:
    return sum(t.float().sum() for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad)


def max_abs_diff(model: torch.nn.Module, optimized: torch.nn.Module, inputs: tuple, training: bool,
                 loss_fn=None) -> float:
    """Largest |optimized - eager| over outputs and, in training, every parameter's gradient
    (inf where an output's shape, or their number, differs).

    Runs on a deep copy of ``model`` with the RNG seeded alike for both, and leaves the
    optimized module's gradients cleared.
    """
    reference = copy.deepcopy(model)
    loss_fn = loss_fn or _default_loss
    torch.manual_seed(0)
    with torch.set_grad_enabled(training):
        expected = reference(*inputs)
    torch.manual_seed(0)
    with torch.set_grad_enabled(training):
        actual = optimized(*inputs)
    diffs = [_leaf_diff(a, e) for a, e in zip(tree_leaves(actual), tree_leaves(expected))
             if isinstance(a, torch.Tensor) and a.numel()]
    if len(tree_leaves(actual)) != len(tree_leaves(expected)):
        diffs.append(math.inf)
    losses = (loss_fn(expected), loss_fn(actual)) if training else ()
    if losses and all(isinstance(loss, torch.Tensor) and loss.requires_grad for loss in losses):
        for m in (reference, optimized):
            m.zero_grad(set_to_none=True)
        for loss in losses:
            loss.backward()
        optimized_params = optimized.model.parameters() if hasattr(optimized, "model") else optimized.parameters()
        diffs += [(p.grad - q.grad).abs().max().item() for p, q in zip(optimized_params, reference.parameters())
                  if p.grad is not None and q.grad is not None]
        optimized.zero_grad(set_to_none=True)
    return max(diffs, default=0.0)
