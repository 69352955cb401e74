"""The runner of a model captured by its torch.fx trace (``torch_fx``): the compiled trace for
calls like those it was compiled for, dynamo on the model for any other (a keyword, grad mode on,
a module swapped, a hook added, autocast)."""
from __future__ import annotations

from typing import Callable

import torch
from torch.utils import _pytree as pytree

from fxdream.capturing.dynamo import RAISED_RECOMPILE_LIMIT, compile_with
from fxdream.capturing.session import CaptureSession


def _signature(args: tuple) -> tuple:
    return tuple((type(a), a.shape, a.stride(), a.dtype, a.device, a.requires_grad)
                 if isinstance(a, torch.Tensor) else (type(a), a) for a in args)


def _shared_storage(args: tuple) -> tuple:
    """Which inputs share memory: for each tensor, the position of the first one on its storage."""
    storages = [a.untyped_storage().data_ptr() if isinstance(a, torch.Tensor) else None for a in args]
    return tuple(None if s is None else storages.index(s) for s in storages)


autocast_enabled = getattr(torch._C, "_is_any_autocast_enabled",  # private; cheap enough for every call
                           lambda: torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda"))


class TracedRunner:
    """Runs the compiled trace for calls like the example; calls with other input shapes,
    strides or dtypes through the same trace compiled for them (``compile_for``: the trace is
    shape-generic, a branch on a shape having raised while tracing), up to ``RAISED_RECOMPILE_LIMIT``
    of them; any other call through dynamo on the model."""

    def __init__(self, model: torch.nn.Module, compiled: Callable, out_spec, example: tuple,
                 session: CaptureSession, grad_enabled: bool = False, mutates_inputs: bool = False,
                 compile_for: Callable[[list], Callable] | None = None):
        self._model, self._out_spec = model, out_spec
        self._grad_enabled = grad_enabled
        self._compiled_for: dict[tuple, Callable | None] = {_signature(example): compiled}
        self._arity = len(example)
        self._compile_for = compile_for
        # a forward that updates an input in place reads it after the update where another input is
        # the same tensor (``opt(x, x)``); the graph, traced with two tensors, does not
        self._shared = _shared_storage(example) if mutates_inputs else None
        self._modules = tuple(model.modules())  # walked once: walking the tree on every call costs host time
        self._holders = tuple(d for m in self._modules for d in (m._parameters, m._buffers, m._modules) if d)
        self._hook_dicts = tuple(d for m in self._modules for d in (m._forward_hooks, m._forward_pre_hooks))
        self._as_traced = self._module_state()
        self._session = session
        self._fallback: Callable | None = None

    def _module_state(self) -> list:
        """Each module's train/eval flag and the objects it holds: its parameters, buffers and
        submodules. The trace read them once; a model that replaced one since (a submodule
        swapped, ``load_state_dict(assign=True)``, a buffer rebound by ``.half()``) is no longer
        the one traced, and runs through dynamo, which captures it as it is."""
        return [m.training for m in self._modules] + [id(v) for held in self._holders for v in held.values()]

    def _hooked(self) -> bool:
        """Whether a forward hook was added since the build (a model with one is never traced):
        the trace ran no hook, and dynamo, as eager, runs them."""
        hooks = torch.nn.modules.module
        return bool(hooks._global_forward_hooks or hooks._global_forward_pre_hooks or any(self._hook_dicts))

    def __call__(self, *args, **kwargs):
        if (not kwargs and torch.is_grad_enabled() == self._grad_enabled
                and self._module_state() == self._as_traced and not self._hooked() and not autocast_enabled()
                and (self._shared is None or _shared_storage(args) == self._shared)):
            compiled = self._compiled_like(args)
            if compiled is not None:
                return pytree.tree_unflatten(list(compiled(*args)), self._out_spec)
        if self._fallback is None:
            self._fallback = compile_with(self._model, self._session)
        return self._fallback(*args, **kwargs)

    def _compiled_like(self, args: tuple) -> Callable | None:
        """The trace compiled for ``args``' signature: the build's, or compiled now (None where
        it cannot be, or ``RAISED_RECOMPILE_LIMIT`` signatures are compiled already)."""
        if len(args) != self._arity or not all(isinstance(a, torch.Tensor) for a in args):
            return None  # another argument given (a default the trace fixed), or a non-tensor: dynamo's
        signature = _signature(args)
        if signature not in self._compiled_for:
            if self._compile_for is None or len(self._compiled_for) >= RAISED_RECOMPILE_LIMIT:
                return None
            records = len(self._session.records)
            try:
                self._compiled_for[signature] = self._compile_for(list(args))
            except Exception:  # the trace does not take these inputs (eager may not either): dynamo's call says
                del self._session.records[records:]  # no graph of the session's is this call's
                self._compiled_for[signature] = None
        return self._compiled_for[signature]
