"""Whether a torch.fx trace computes what eager does: both run on the example and are compared.

A symbolic trace cannot bake in a batch size (a shape is a Proxy, and a branch on one raises
while tracing), so where every input has the same batch dimension the two run on its first and
last samples alone: the check then costs a fraction of two full calls, which on a large batch
are a large share of a build. Two samples, not one: a branch the trace dropped can leave one
sample as eager computes it (a padding mask the trace never applies, on the batch's longest
sequence, which a length-sorted batch puts first and its shortest last). The whole example is
run instead where the samples are not a valid input (eager or the trace raises on them) and
where the trace returns something other than tensors (a leaf module's tuple, whose length can
follow the batch).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from fxdream.capturing.model_state import preserved_inputs
from fxdream.runtime.graph_guards import tensor_version

_TOLERANCE = {torch.float16: (1e-2, 1e-3), torch.bfloat16: (5e-2, 1e-2)}


@dataclass(frozen=True)
class BothRuns:
    """Eager's output and the trace's flat values on the same inputs."""
    expected: object
    values: list
    mutates_inputs: bool  # forward updated an input in place (or may have: inference tensors)
    on_samples: bool  # on the first and last samples, not the whole example


def probe_samples(inputs: tuple) -> tuple | None:
    """The example's first and last samples (copies: an in-place update by forward stays in
    them), where every input is a tensor whose first dimension has the same size, over 2; else None."""
    if not inputs or not all(isinstance(x, torch.Tensor) and x.dim() >= 1 for x in inputs):
        return None
    if len({x.shape[0] for x in inputs}) != 1 or inputs[0].shape[0] <= 2:
        return None
    return tuple(x[[0, -1]] for x in inputs)


def run_both(model: torch.nn.Module, traced: fx.GraphModule, inputs: tuple) -> BothRuns:
    """Eager and the trace on two samples of ``inputs`` where that settles it (see the module's
    docstring), else on all of them; each run from the same RNG state. Raises what a run
    on the whole example raises."""
    samples = probe_samples(inputs)
    if samples is not None:
        try:
            runs = _run_both(model, traced, samples, on_samples=True)
        except Exception:  # the samples may not be a valid input (a batch size forward fixes)
            runs = None
        if runs is not None and all(isinstance(v, torch.Tensor) for v in runs.values):
            return runs
    return _run_both(model, traced, inputs, on_samples=False)


def _run_both(model, traced, inputs: tuple, on_samples: bool) -> BothRuns:
    devices = sorted({t.device.index for t in list(model.parameters()) + list(inputs)
                      if t.device.type == "cuda" and t.device.index is not None})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        with preserved_inputs(inputs):  # the traced run gets the inputs eager got
            input_versions = [tensor_version(x) for x in inputs]
            expected = model(*inputs)
            mutates_inputs = [tensor_version(x) for x in inputs] != input_versions or (
                None in input_versions and torch.is_inference_mode_enabled())  # unknown: assume it may
        torch.manual_seed(0)
        values = list(traced(*inputs))
    return BothRuns(expected, values, mutates_inputs, on_samples)


def module_state(model: torch.nn.Module) -> list:
    """Every module's plain attributes, parameters and buffers (identity of each value): what a
    forward with Python side effects (a counter, a cache, a state rebound) changes."""
    skip = {"_parameters", "_buffers", "_modules", "training"}
    return [(name, key, id(value)) for name, m in model.named_modules()
            for key, value in [*vars(m).items(), *m._parameters.items(), *m._buffers.items()] if key not in skip]


def same_leaves(expected, values: list) -> bool:
    """Whether eager's output holds the trace's values, in order, whatever its containers (a
    ``ModelOutput`` where the trace builds a plain dict)."""
    leaves = pytree.tree_leaves(expected)
    return len(leaves) == len(values) and same(leaves, list(values))


def same(expected, actual) -> bool:
    """Equal structure and values: integers exactly, floating point within rounding."""
    e_leaves, e_spec = pytree.tree_flatten(expected)
    a_leaves, a_spec = pytree.tree_flatten(actual)
    if e_spec != a_spec:
        return False
    for e, a in zip(e_leaves, a_leaves):
        if isinstance(e, torch.Tensor) != isinstance(a, torch.Tensor):
            return False
        if isinstance(e, torch.Tensor):
            # loose enough for kernels that differ call to call (cuDNN's autotuner, TF32), far
            # tighter than a wrong branch
            if e.shape != a.shape or e.dtype != a.dtype:
                return False
            if not (e.is_floating_point() or e.is_complex()):
                if not torch.equal(e, a):
                    return False
                continue
            rtol, atol = _TOLERANCE.get(e.dtype, (1e-4, 1e-5))
            if not torch.allclose(e, a, rtol=rtol, atol=atol, equal_nan=True):
                return False
        elif e != a:
            return False
    return True
