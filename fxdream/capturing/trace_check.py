"""Whether a torch.fx trace computes what eager does: both run on the example and are compared.

A symbolic trace cannot bake in a batch size (a shape is a Proxy, and a branch on one raises
while tracing), so where the example has a batch dimension the two run on its first and last
samples alone: the check then costs a fraction of two full calls, which on a large batch
are a large share of a build. Only a model of one input: a second (a padding mask, lengths)
makes samples differ in what a branch the trace dropped would have done, in any order of the
batch, so such an example is run whole. The whole example is run too where the samples are
not a valid input (eager or the trace raises on them) and where the trace returns something
other than tensors (a leaf module's tuple, whose length can follow the batch).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from fxdream.capturing.model_state import preserved_inputs
from fxdream.ir.graphs import attribute_of
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
    them), where the example is one tensor whose first dimension is over 2; else None. A second
    input (a mask, lengths) can make samples differ in what a dropped branch does, in any order:
    such an example is checked whole."""
    if len(inputs) != 1 or not isinstance(inputs[0], torch.Tensor) or inputs[0].dim() < 1 or inputs[0].shape[0] <= 2:
        return None
    return (inputs[0][[0, -1]],)


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
        values = list(traced.forward(*inputs))  # not __call__: torch.fx's wrapper prints a failing trace's error
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


# in-place Python operators (``acc += x`` on a tensor the forward made: a trace records them as is)
_IN_PLACE_OPERATORS = frozenset((operator.setitem, operator.iadd, operator.isub, operator.imul, operator.itruediv,
                                 operator.ifloordiv, operator.imod, operator.ipow, operator.iand, operator.ior,
                                 operator.ixor, operator.ilshift, operator.irshift, operator.imatmul))
# methods whose result shares its input's memory: an update through it updates the input
_VIEW_METHODS = frozenset(("view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t", "narrow",
                           "select", "squeeze", "unsqueeze", "expand", "expand_as", "flatten", "unflatten",
                           "as_strided", "diagonal", "unbind", "split", "chunk", "movedim", "swapaxes",
                           "__getitem__", "T", "mT", "real", "imag", "detach"))


def constant_updated_in_place(gm: fx.GraphModule, model: torch.nn.Module) -> str | None:
    """The name of a tensor constant of ``model``'s trace ``gm`` (one the forward made while
    tracing, not a parameter or buffer of ``model``) that an op of the trace updates in place,
    directly or through a view; None where none is. torch.fx keeps such a tensor
    (``torch.zeros(8)``) as one constant, so ``acc += x`` would add to the same tensor call after
    call, where eager starts from zeros."""
    state = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    made: dict[fx.Node, str] = {}  # node → the constant its value is (a view of)
    for node in gm.graph.nodes:
        if (node.op == "get_attr" and node.target not in state
                and isinstance(attribute_of(gm, node.target), torch.Tensor)):
            made[node] = node.target
            continue
        first = node.args[0] if node.args else None
        if not isinstance(first, fx.Node) or first not in made:
            continue
        if _updates_in_place(node):
            return made[first]
        if (node.op == "call_method" and node.target in _VIEW_METHODS) or node.target is operator.getitem:
            made[node] = made[first]
    return None


def _updates_in_place(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target == "__setitem__" or (node.target.endswith("_") and not node.target.startswith("_"))
    if node.op == "call_function":
        name = getattr(node.target, "__name__", "")
        return node.target in _IN_PLACE_OPERATORS or (name.endswith("_") and not name.startswith("_"))
    return False
