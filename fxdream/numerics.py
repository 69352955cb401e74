"""Numerical equality of an optimized module against eager (outputs and gradients), and the
deviation of a reduced-precision module from float32."""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch

from fxdream.capturing.steps import cut_from_callers_graph, differentiable_scalar, output_leaves


@dataclass(frozen=True)
class Difference:
    """How far the optimized module's outputs (and, in training, gradients) are from eager's:
    ``max_abs``, the largest |optimized - eager|; ``max_scaled``, the largest of each tensor's
    largest difference over its largest |eager value| (at least 1), which rounding keeps small
    whatever the outputs' magnitude. Values equal on both sides (NaN and NaN, inf and inf) differ
    by 0, a NaN on one side only by inf."""
    max_abs: float
    max_scaled: float

    @classmethod
    def of(cls, pairs) -> "Difference":
        """Of ``(largest difference, largest |eager value|)`` pairs, one per tensor compared."""
        pairs = list(pairs)
        return cls(max((d for d, _ in pairs), default=0.0),
                   max((d / max(1.0, scale) for d, scale in pairs), default=0.0))


def _tensor_diff(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, float]:
    """(largest |actual - expected|, largest finite |expected|), both as ``Difference`` counts them."""
    if not actual.numel():
        return 0.0, 0.0
    a, e = actual.detach().float(), expected.detach().float()
    same = (a == e) | (a.isnan() & e.isnan())
    diff = torch.where(same, 0.0, (a - e).abs().nan_to_num(nan=math.inf)).max().item()
    finite = e.abs()[e.isfinite()]
    return diff, (finite.max().item() if finite.numel() else 0.0)


def _leaf_diff(actual, expected) -> tuple[float, float]:
    """``_tensor_diff``; inf where the two are not alike (shape, or not both tensors): broadcasting
    would make a 0-d output against eager's (3, 4) read as a small difference."""
    if not isinstance(expected, torch.Tensor) or actual.shape != expected.shape:
        return math.inf, 0.0
    return _tensor_diff(actual, expected)


ONE_SIDED_GRADIENT = ("{names}: a gradient on one side only (eager's is {eager}); torch.utils.checkpoint with "
                      "use_reentrant=True and no input that requires grad leaves its block's parameters without "
                      "gradients in eager, where captured graphs compute them")


def _own_copies(inputs):
    """Copies of ``inputs``' tensors, leaves as leaves and others as others (``clone``, whose
    gradient goes to the tensor it copies): a forward that updates its input in place must not
    hand the second model a changed one."""
    def copied(value):
        if not isinstance(value, torch.Tensor):
            return value
        if value.grad_fn is not None:
            return value.clone()
        return value.detach().clone().requires_grad_(value.requires_grad)
    return torch.utils._pytree.tree_map(copied, inputs)


def _reference_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` to run eagerly beside the optimized module. A tensor a forward left
    on a module inside autograd's graph (an activation kept as ``self.last``, the weight the
    hook of ``nn.utils.weight_norm`` computes) refuses ``copy.deepcopy``: the copy holds it
    detached, as the next forward recomputes it."""
    in_graph = {id(value): value.detach().clone() for module in model.modules() for value in vars(module).values()
                if isinstance(value, torch.Tensor) and value.grad_fn is not None}
    return copy.deepcopy(model, in_graph)


def max_abs_diff(model: torch.nn.Module, optimized: torch.nn.Module, inputs: tuple, training: bool,
                 loss_fn=None, causes: list | None = None) -> float:
    """``difference(...).max_abs``."""
    return difference(model, optimized, inputs, training, loss_fn, causes).max_abs


def difference(model: torch.nn.Module, optimized: torch.nn.Module, inputs: tuple, training: bool,
               loss_fn=None, causes: list | None = None) -> Difference:
    """|optimized - eager| over outputs and, in training, every parameter's gradient (inf where
    an output's shape, or their number, differs; a gradient on one side only counts as its
    largest value, and ``causes`` gets a line naming those parameters).

    Runs on a deep copy of ``model`` with the RNG seeded alike for both, each on its own copy of
    ``inputs``, and leaves the optimized module's gradients cleared.
    """
    reference = _reference_copy(model)
    loss_fn = loss_fn or differentiable_scalar  # every output that needs a gradient, summed
    if training:
        inputs = cut_from_callers_graph(inputs)
    torch.manual_seed(0)
    with torch.set_grad_enabled(training):
        expected = reference(*_own_copies(inputs))
    torch.manual_seed(0)
    with torch.set_grad_enabled(training):
        actual = optimized(*_own_copies(inputs))
    actual_leaves, expected_leaves = output_leaves(actual), output_leaves(expected)
    diffs = [_leaf_diff(a, e) for a, e in zip(actual_leaves, expected_leaves)
             if isinstance(a, torch.Tensor) and a.numel()]
    if len(actual_leaves) != len(expected_leaves):
        diffs.append((math.inf, 0.0))
    losses = (loss_fn(expected), loss_fn(actual)) if training else ()
    if losses and all(isinstance(loss, torch.Tensor) and loss.requires_grad for loss in losses):
        for m in (reference, optimized):
            m.zero_grad(set_to_none=True)
        for loss in losses:
            loss.backward()
        owner = optimized.model if hasattr(optimized, "model") else optimized
        diffs += _gradient_diffs(owner, reference, causes)
        optimized.zero_grad(set_to_none=True)
    return Difference.of(diffs)


def _gradient_diffs(optimized: torch.nn.Module, reference: torch.nn.Module,
                    causes: list | None) -> list[tuple[float, float]]:
    """``_tensor_diff`` of each parameter's gradient; a gradient on one side only differs by its
    largest |value| (named in ``causes``)."""
    diffs, one_sided = [], []
    for (name, p), q in zip(optimized.named_parameters(), reference.parameters()):
        if p.grad is not None and q.grad is not None:
            diffs.append(_tensor_diff(p.grad, q.grad))
        elif (p.grad is None) != (q.grad is None):
            grad = p.grad if p.grad is not None else q.grad
            diffs.append((grad.abs().max().item() if grad.numel() else 0.0, 0.0))
            one_sided.append((name, q.grad is None))
    if one_sided and causes is not None:
        names = ", ".join(name for name, _ in one_sided[:3]) + (f" and {len(one_sided) - 3} more"
                                                                if len(one_sided) > 3 else "")
        causes.append(ONE_SIDED_GRADIENT.format(names=names, eager="None" if one_sided[0][1] else "set"))
    return diffs


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
    """``optimized``'s outputs against ``model``'s (float32, eager) on ``inputs``, under no_grad:
    each on its own copy of ``inputs`` (a forward updating one in place) from the same RNG state
    (dropout left on). A NaN or infinity on both sides at one place is no deviation; on one side
    only it is an infinite one. Top-class agreement is read on the first 2-d output of more than
    one column (a classifier's logits)."""
    with torch.no_grad():
        torch.manual_seed(0)
        expected = model(*_own_copies(inputs))
        torch.manual_seed(0)
        actual = optimized(*_own_copies(inputs))
    pairs = [(a.float(), e.float()) for a, e in zip(output_leaves(actual), output_leaves(expected))
             if isinstance(a, torch.Tensor) and isinstance(e, torch.Tensor) and e.is_floating_point()
             and a.shape == e.shape and e.numel()]
    if not pairs:
        return Deviation(0.0, 0.0)
    max_abs = max(_abs_difference(a, e).max().item() for a, e in pairs)
    scale = max(e[e.isfinite()].abs().max().item() if e.isfinite().any() else 0.0 for _, e in pairs)
    logits = next(((a, e) for a, e in pairs if e.dim() == 2 and e.shape[-1] > 1), None)
    agreement = None if logits is None else (logits[0].argmax(-1) == logits[1].argmax(-1)).float().mean().item()
    return Deviation(max_abs, max_abs / scale if scale else 0.0, agreement)


def _abs_difference(actual: torch.Tensor, expected: torch.Tensor) -> torch.Tensor:
    """|actual - expected|: 0 where both are equal or NaN, infinite where one side only is NaN."""
    same = (actual == expected) | (actual.isnan() & expected.isnan())
    difference = torch.where(same, 0.0, (actual - expected).abs())
    return torch.where(difference.isnan(), torch.inf, difference)
