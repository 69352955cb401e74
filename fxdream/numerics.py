"""Numerical equality of an optimized module against eager (outputs and gradients), and the
deviation of a reduced-precision module from float32."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from fxdream.capturing.steps import cut_from_callers_graph, differentiable_scalar, output_leaves


def _leaf_diff(actual, expected) -> float:
    """Max |actual - expected|; inf where the two are not alike (shape, or not both tensors):
    broadcasting would make a 0-d output against eager's (3, 4) read as a small difference."""
    if not isinstance(expected, torch.Tensor) or actual.shape != expected.shape:
        return math.inf
    return (actual.float() - expected.float()).abs().max().item()


def max_abs_diff(model: torch.nn.Module, optimized: torch.nn.Module, inputs: tuple, training: bool,
                 loss_fn=None) -> float:
    """Largest |optimized - eager| over outputs and, in training, every parameter's gradient
    (inf where an output's shape, or their number, differs).

    Runs on a deep copy of ``model`` with the RNG seeded alike for both, and leaves the
    optimized module's gradients cleared.
    """
    reference = copy.deepcopy(model)
    loss_fn = loss_fn or differentiable_scalar  # every output that needs a gradient, summed
    if training:
        inputs = cut_from_callers_graph(inputs)
    torch.manual_seed(0)
    with torch.set_grad_enabled(training):
        expected = reference(*inputs)
    torch.manual_seed(0)
    with torch.set_grad_enabled(training):
        actual = optimized(*inputs)
    actual_leaves, expected_leaves = output_leaves(actual), output_leaves(expected)
    diffs = [_leaf_diff(a, e) for a, e in zip(actual_leaves, expected_leaves)
             if isinstance(a, torch.Tensor) and a.numel()]
    if len(actual_leaves) != len(expected_leaves):
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


@dataclass(frozen=True)
class Deviation:
    """How far a reduced-precision module's outputs are from float32 eager's on the same inputs:
    ``max_abs`` (largest |difference|), ``max_rel`` (that over the largest |eager output|: the
    error at the outputs' own scale, not inflated by outputs near zero), and for a classifier
    head (a 2-d float output, one row per example) ``argmax_agreement``, the share of rows whose
    top class is the same (None for other outputs)."""
    max_abs: float
    max_rel: float
    argmax_agreement: float | None = None

    def describe(self) -> str:
        agreement = "" if self.argmax_agreement is None else \
            f", same top class in {self.argmax_agreement:.0%} of the example batch"
        return f"max abs {self.max_abs:.2e}, max rel {self.max_rel:.2e}{agreement}"


def deviation(model: torch.nn.Module, optimized: torch.nn.Module, inputs: tuple) -> Deviation:
    """``optimized``'s outputs against ``model``'s (float32, eager) on ``inputs``, under no_grad."""
    with torch.no_grad():
        expected, actual = model(*inputs), optimized(*inputs)
    pairs = [(a.float(), e.float()) for a, e in zip(output_leaves(actual), output_leaves(expected))
             if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor) and e.is_floating_point()
             and a.shape == e.shape and e.numel()]
    if not pairs:
        return Deviation(0.0, 0.0)
    max_abs = max((a - e).abs().max().item() for a, e in pairs)
    scale = max(e.abs().max().item() for _, e in pairs)
    first_a, first_e = pairs[0]
    agreement = (first_a.argmax(-1) == first_e.argmax(-1)).float().mean().item() \
        if first_e.dim() == 2 and first_e.shape[-1] > 1 else None
    return Deviation(max_abs, max_abs / scale if scale else 0.0, agreement)
