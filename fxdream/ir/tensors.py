"""Tensors as the stages see them: real or fake, sizes that may be symbolic, bytes, layouts."""
from __future__ import annotations

import contextlib

import torch
from torch.utils._pytree import tree_flatten


@contextlib.contextmanager
def real_tensors():
    """Measurements need real tensors and plain dispatch, also inside aot_autograd's compiler
    callbacks: its fake mode is on there, and where it has a shape env (dynamo's captures, and
    some torch.fx ones) so is the Python dispatcher, which sends every op through Python. Under
    it, an op that is a composite of many ATen calls (an inference GRU) times several times slower
    than it runs, and its graph is predicted that much too slow."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily  # private; isolated here
    with unset_fake_temporarily(), torch._C._DisablePythonDispatcher():
        yield


def size_hint(x):
    """A concrete int for a symbolic size (dynamo's dynamic shapes: the size it was traced at),
    so costs and memory of a symbolic graph are those of its example; other values as they are."""
    if isinstance(x, torch.SymInt):
        from torch.fx.experimental.symbolic_shapes import optimization_hint  # no guard added
        return optimization_hint(x, fallback=1)
    return x


def has_symbols(value) -> bool:
    """Whether ``value`` is a symbolic int, or a tensor with a symbolic size or stride (dynamo's
    dynamic shapes)."""
    if isinstance(value, torch.SymInt):
        return True
    return isinstance(value, torch.Tensor) and any(isinstance(s, torch.SymInt) for s in (*value.shape, *value.stride()))


def without_symbols(value):
    """``value`` as a meta tensor of its hinted sizes and strides where any is symbolic (dynamo's
    dynamic shapes), so that a check on it (``is_contiguous``, a comparison, an ``int``) adds no
    guard: a guard on a size would fix it for the whole graph. Anything else as it is."""
    if not isinstance(value, torch.Tensor) or not has_symbols(value):
        return value
    return torch.empty_strided([size_hint(s) for s in value.shape], [size_hint(s) for s in value.stride()],
                               dtype=value.dtype, device="meta")


def same_layout(a, b) -> bool:
    """Two tensors (fake or real) of one dtype, shape and strides."""
    return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
            and tuple(a.shape) == tuple(b.shape) and tuple(a.stride()) == tuple(b.stride()))


def tensor_bytes(value) -> int:
    leaves, _ = tree_flatten(value)
    return sum(size_hint(t.numel()) * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
