"""A model and its inputs on the meta device: shapes, dtypes and strides without data. A
prediction for a device that is not here captures such a copy, so the model never runs on real
data on this machine (no activations allocated: any batch size, any model size)."""
from __future__ import annotations

import contextlib
import copy
import functools
import itertools

import torch
from torch._C import DispatchKey
from torch._subclasses.fake_tensor import fake_tensor_tls
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_leaves, tree_map

from fxdream.capturing.model_state import uninitialized_lazy_modules
from fxdream.ir.nodes import LAYER

aten = torch.ops.aten
# ops whose CPU and CUDA kernels refuse operands of two dtypes, where the meta device's accept them
_ONE_DTYPE_OPS = (aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default,
                  aten.convolution.default)


def on_meta(model: torch.nn.Module, inputs=(), kwargs=None) -> bool:
    """Whether the model's parameters or buffers, or the inputs, live on the meta device."""
    tensors = itertools.chain(model.parameters(), model.buffers(), tree_leaves((inputs, kwargs or {})))
    return any(isinstance(t, torch.Tensor) and t.device.type == "meta" for t in tensors)


def check_meta_on_both_sides(model: torch.nn.Module, inputs=(), kwargs=None) -> None:
    """A model on the meta device takes its floating inputs on the meta device too, and a model
    with data takes none there: torch's error for the mix comes from deep inside a fake-tensor
    trace. (Integer tensors may stay on the CPU beside a meta model: ``pack_padded_sequence``'s
    lengths must.)"""
    state = list(itertools.chain(model.parameters(), model.buffers()))
    tensors = [t for t in tree_leaves((inputs, kwargs or {})) if isinstance(t, torch.Tensor)]
    if any(t.device.type == "meta" for t in state):
        data = [t for t in tensors if t.device.type != "meta" and (t.is_floating_point() or t.is_complex())]
        if data:
            raise ValueError(f"the model is on the meta device and an example input is on {data[0].device} "
                             f"(shape {tuple(data[0].shape)}): make the inputs on the meta device too "
                             f"(torch.randn(..., device='meta'))")
    elif state and any(t.device.type == "meta" for t in tensors):
        raise ValueError(f"an example input is on the meta device and the model's weights are on "
                         f"{state[0].device}: build the model on the meta device too (with torch.device('meta'): "
                         f"model = ...), or give inputs with data")


def meta_copy(model: torch.nn.Module, inputs: tuple, kwargs: dict | None = None, lengths_on_cpu: bool = False):
    """(the model, inputs, kwargs) with every parameter, buffer and input tensor on the meta
    device: the model is deep-copied with its tensors replaced by meta ones (no data copied),
    the original is left as it was. ``lengths_on_cpu``: 1-d integer input tensors stay as they
    are, as ``pack_padded_sequence`` takes its lengths on the CPU whatever the model's device."""
    _refuse_uninitialized(model)
    memo: dict[int, torch.Tensor] = {}
    if lengths_on_cpu:
        memo.update((id(t), t) for t in tree_leaves((inputs, kwargs or {}))
                    if isinstance(t, torch.Tensor) and t.dim() == 1 and not t.is_floating_point()
                    and not t.is_complex() and t.device.type == "cpu")
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if id(tensor) not in memo:
            meta = tensor.detach().to("meta")
            memo[id(tensor)] = torch.nn.Parameter(meta, requires_grad=tensor.requires_grad) \
                if isinstance(tensor, torch.nn.Parameter) else meta
    copied = copy.deepcopy(model, dict(memo))
    packed, to_meta = (lambda v: isinstance(v, PackedSequence)), functools.partial(_to_meta, memo)
    return (copied, tree_map(to_meta, tuple(inputs), is_leaf=packed),
            tree_map(to_meta, dict(kwargs or {}), is_leaf=packed))


def _refuse_uninitialized(model: torch.nn.Module) -> None:
    """A lazy module not yet called has no shapes, and only a call on real data gives them."""
    lazy = [f"{name or '(the model)'} ({type(m).__name__})" for name, m in uninitialized_lazy_modules(model)]
    if lazy:
        raise ValueError(f"lazy module {', '.join(lazy[:3])}{' and more' if len(lazy) > 3 else ''} not yet called: "
                         f"its weights have no shape, and this prediction runs nothing on real data; call the "
                         f"model once on an example batch first (or build it with its input sizes)")


def _to_meta(memo: dict, value):
    """A tensor's meta twin (same ``requires_grad``), one per tensor (``memo``: an input given
    twice, or a parameter given as an input, stays one tensor, whose gradients add up); a
    PackedSequence with its data and indices on the meta device and its ``batch_sizes`` left on
    the CPU, where torch requires them."""
    if isinstance(value, PackedSequence):
        indices = (None if t is None else t.to("meta") for t in (value.sorted_indices, value.unsorted_indices))
        return PackedSequence(_to_meta(memo, value.data), value.batch_sizes, *indices)
    if not isinstance(value, torch.Tensor):
        return value
    if id(value) not in memo:
        memo[id(value)] = value.detach().to("meta").requires_grad_(value.requires_grad)
    return memo[id(value)]


@contextlib.contextmanager
def traceable_on_meta(active: bool = True):
    """While a model on the meta device is captured (``active``), two things torch's tracing does
    only on the meta device are undone, so the graphs are those a capture on real tensors makes:

    - a tensor forward makes on the meta device inside the traced code (``torch.tensor([],
      device=x.device)`` in transformers' KV cache, an index list ``x[..., [-2]]``, a scalar for
      ``torch.where``) is a real meta tensor in dynamo's trace, which its fake tensors refuse to
      mix with: the fake mode converts it (``allow_non_fake_inputs``, a private thread-local
      switch; no data on either side, nothing lost);
    - ops that decompose for autograd (CompositeImplicitAutograd: ``nll_loss``, ``relu6``,
      ``dropout``, ``prelu``) also have Python meta kernels, which the tracer's Python dispatcher
      prefers, so autograd records them without a gradient formula (torch warns "an autograd
      kernel was not registered") and the backward graph misses them and all before them (a
      cross-entropy loss's backward is empty). Those kernels are set aside meanwhile
      (``aten.item``'s kept: it says why a meta tensor has no value)."""
    if not active:
        yield
        return
    before = fake_tensor_tls.allow_non_fake_inputs_override
    fake_tensor_tls.allow_non_fake_inputs_override = True
    set_aside = {op: op.py_kernels.pop(DispatchKey.Meta) for op in _composite_ops_with_python_meta()}
    for op in set_aside:
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        fake_tensor_tls.allow_non_fake_inputs_override = before
        for op, kernel in set_aside.items():
            op.py_kernels[DispatchKey.Meta] = kernel
            op._dispatch_cache.clear()


@functools.cache
def _composite_ops_with_python_meta() -> tuple:
    """The ATen ops that decompose for autograd and have a Python meta kernel (torch registers one
    for the ops of its decomposition tables, and some more). A Python kernel is registered on an
    op object, so the ops are among those created already (``vars`` of ``torch.ops.aten``)."""
    return tuple(op for packet in list(vars(torch.ops.aten).values()) if isinstance(packet, torch._ops.OpOverloadPacket)
                 for op in list(vars(packet).values()) if isinstance(op, torch._ops.OpOverload)
                 and DispatchKey.Meta in op.py_kernels and op is not torch.ops.aten.item.default
                 and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"))


def mixed_dtype_call(graphs) -> str | None:
    """What a captured graph (an ``fx.GraphModule`` of ``graphs``) calls with operands of two
    dtypes, which eager's kernels refuse and the meta device's run (``nn.Linear`` on int64
    input: "mat1 and mat2 must have the same dtype"); None where nothing does."""
    for gm in graphs:
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target not in _ONE_DTYPE_OPS:
                continue
            dtypes = {arg.meta["val"].dtype for arg in node.all_input_nodes
                      if isinstance(arg.meta.get("val"), torch.Tensor)}
            if len(dtypes) > 1:
                names = " and ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
                return (f"{node.target.overloadpacket.__name__} in {node.meta.get(LAYER) or 'the model'} takes {names} "
                        f"operands, which eager refuses (the meta device's kernels do not check): give the inputs "
                        f"the dtype of the model's weights")
    return None
