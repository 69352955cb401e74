"""A model and its inputs on the meta device: shapes, dtypes and strides without data. A
prediction for a device that is not here captures such a copy, so the model never runs on real
data on this machine (no activations allocated: any batch size, any model size)."""
from __future__ import annotations

import contextlib
import copy
import itertools

import torch
from torch._subclasses.fake_tensor import fake_tensor_tls
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_leaves, tree_map


def on_meta(model: torch.nn.Module, inputs=(), kwargs=None) -> bool:
    """Whether the model's parameters or buffers, or the inputs, live on the meta device."""
    tensors = itertools.chain(model.parameters(), model.buffers(), tree_leaves((inputs, kwargs or {})))
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors)


def meta_copy(model: torch.nn.Module, inputs: tuple, kwargs: dict | None = None):
    """(the model, inputs, kwargs) with every parameter, buffer and input tensor on the meta
    device: the model is deep-copied with its tensors replaced by meta ones (no data copied),
    the original is left as it was."""
    memo: dict[int, torch.Tensor] = {}
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if id(tensor) not in memo:
            meta = tensor.detach().to("meta")
            memo[id(tensor)] = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad) \
                if isinstance(tensor, torch.nn.Parameter) else meta
    copied = copy.deepcopy(model, memo)
    packed = lambda v: isinstance(v, PackedSequence)  # noqa: E731
    return (copied, tree_map(_to_meta, tuple(inputs), is_leaf=packed),
            tree_map(_to_meta, dict(kwargs or {}), is_leaf=packed))


def _to_meta(value):
    """A tensor's meta twin (same ``requires_grad``); a PackedSequence with its data and indices
    on the meta device and its ``batch_sizes`` left on the CPU, where torch requires them."""
    if isinstance(value, PackedSequence):
        indices = (None if t is None else t.to("meta") for t in (value.sorted_indices, value.unsorted_indices))
        return PackedSequence(_to_meta(value.data), value.batch_sizes, *indices)
    if isinstance(value, torch.Tensor):
        return value.detach().to("meta").requires_grad_(value.requires_grad)
    return value


@contextlib.contextmanager
def meta_constants_traced(active: bool = True):
    """While a model on the meta device is captured (``active``): a tensor its forward makes on
    the meta device inside the traced code (``torch.tensor([], device=x.device)`` in transformers'
    KV cache, an index list ``x[..., [-2]]``, a scalar for ``torch.where``) is a real meta tensor
    in dynamo's trace, and its fake tensors refuse to mix with one; with no data on either side,
    converting it to a fake tensor (fake mode's ``allow_non_fake_inputs``, a private thread-local
    switch, set here only) loses nothing."""
    if not active:
        yield
        return
    before = fake_tensor_tls.allow_non_fake_inputs_override
    fake_tensor_tls.allow_non_fake_inputs_override = True
    try:
        yield
    finally:
        fake_tensor_tls.allow_non_fake_inputs_override = before
