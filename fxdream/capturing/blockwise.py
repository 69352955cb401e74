"""When neither dynamo nor torch.fx captures a model's forward: capture its blocks one by one.

Dynamo gives up on a whole function at a graph break it cannot resume after (a data-dependent
``if float(x.mean()) > 10`` inside the loop over the blocks), and torch.fx cannot trace such a
forward either, so without this the model would run wholly eagerly. Its blocks usually trace: each module
the forward calls itself (found by one eager step) is compiled through the capture session,
and the forward runs as written, eagerly, calling the compiled blocks. The
model is not changed: the compiled calls are installed in ``_compiled_call_impl`` (what
``nn.Module.compile`` sets) only for the duration of each call.
"""
from __future__ import annotations

import types

import torch

from fxdream.capturing.dynamo import compiled_through, graph_break_counts, new_graph_breaks
from fxdream.capturing.session import CaptureSession
from fxdream.capturing.steps import run_once
from fxdream.capturing.torch_fx import capture_from_trace


def called_blocks(model: torch.nn.Module, inputs: tuple, training: bool) -> list[torch.nn.Module]:
    """The submodules the forward itself calls (not the ones they call), in first-call order:
    found by one eager step with hooks on every submodule. Not just the children: a forward
    that calls ``self.backbone.layer1(x)`` calls a grandchild."""
    depth, called = [0], {}

    def enter(module, args):
        if depth[0] == 0:
            called.setdefault(id(module), module)
        depth[0] += 1

    def leave(module, args, output):
        depth[0] -= 1
    handles = []
    try:  # a TorchScript submodule takes no Python hooks (and is not a block dynamo can compile)
        for m in model.modules():
            if m is not model and not isinstance(m, torch.jit.ScriptModule):
                handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
        run_once(model, model, inputs, training)
    finally:
        for handle in handles:
            handle.remove()
    return [m for m in called.values() if getattr(m, "_compiled_call_impl", None) is None]  # not compiled already


class BlockwiseRunner:
    """Calls the model eagerly with each of its blocks compiled through ``session``."""

    def __init__(self, model: torch.nn.Module, session: CaptureSession, blocks: list[torch.nn.Module]):
        self._model = model
        self._blocks = blocks
        names = {id(m): name for name, m in model.named_modules()}  # a module's first name, as torch gives it
        self._compiled = [_compiled_call(b, i, session, names.get(id(b)) or f"block_{i}")
                          for i, b in enumerate(self._blocks)]

    def __len__(self) -> int:
        return len(self._blocks)

    def __call__(self, *args, **kwargs):
        for block, compiled in zip(self._blocks, self._compiled):
            block._compiled_call_impl = compiled
        try:
            return self._model(*args, **kwargs)
        finally:
            for block in self._blocks:
                block._compiled_call_impl = None


class _Call(torch.nn.Module):
    """``block(...)`` as the forward of a module of fxdream's own: dynamo traces the call whole,
    hooks included (compiling ``block`` itself runs its forward without its hooks; compiling
    ``block._call_impl``, as ``nn.Module.compile`` does, captures nothing for ``nn.Sequential``:
    dynamo skips frames in torch.nn's own files). The block sits at its own qualified name in
    the model (``path``: "ex.0" under a module "ex"), so the graph's module paths, and the
    layers named from them, are the model's."""

    def __init__(self, block: torch.nn.Module, path: str):
        super().__init__()
        self.path = tuple(path.split("."))
        holder = self
        for part in self.path[:-1]:
            holder.add_module(part, torch.nn.Module())
            holder = getattr(holder, part)
        holder.add_module(self.path[-1], block)

    def forward(self, *args, **kwargs):
        target = self
        for part in self.path:
            target = getattr(target, part)
        return target(*args, **kwargs)


def _own_call(block: torch.nn.Module, index: int, path: str) -> _Call:
    """A ``_Call`` whose forward has a code object of its own: dynamo keeps its compiled graphs
    per code object and does not guard on hooks, so with a shared code object, blocks of one class
    would share the graph of the first one traced, and a forward hook on another block would never run.
    One graph per block also
    lets an inference rewrite take each block's weights as constants."""
    code = _Call.forward.__code__
    names = {"co_name": f"block_{index}"} | ({"co_qualname": f"block_{index}"} if hasattr(code, "co_qualname") else {})
    code = code.replace(**names)  # co_qualname: Python 3.11 and later
    forward = types.FunctionType(code, _Call.forward.__globals__, code.co_name)
    return type(f"_Call{index}", (_Call,), {"forward": forward})(block, path)


def _compiled_call(block: torch.nn.Module, index: int, session: CaptureSession, path: str):
    """``block``'s call through dynamo with ``session``, for ``block._compiled_call_impl``; while
    it runs the slot is empty, so that the block's own ``__call__`` does not come back here."""
    compiled = compiled_through(_own_call(block, index, path), session)

    def call(*args, **kwargs):
        block._compiled_call_impl = None
        try:
            return compiled(*args, **kwargs)
        finally:
            block._compiled_call_impl = call
    return call


def capture_blockwise(model: torch.nn.Module, inputs: tuple, session: CaptureSession, training: bool,
                      breaks: tuple) -> tuple[BlockwiseRunner, str, tuple] | None:
    """(runner, how, graph breaks: the forward's ``breaks`` and the blocks') capturing ``model``'s
    blocks, or None where that captures nothing (no blocks, or none of them traces)."""
    breaks_before, records = graph_break_counts(), len(session.records)
    try:
        runner = BlockwiseRunner(model, session, called_blocks(model, inputs, training))
        if not len(runner):
            return None
        run_once(runner, model, inputs, training)
    except Exception:  # a last chance only: the caller reports the first failure
        del session.records[records:]
        return None
    if not session.captured():
        return None
    why = "; ".join(b.rstrip(".") for b in breaks) or "no graph"
    return (runner, f"dynamo per block, the forward eager ({len(runner)} modules it calls; neither dynamo "
            f"on forward nor torch.fx captured it: {why})",
            tuple(dict.fromkeys(tuple(breaks) + new_graph_breaks(breaks_before))))  # the forward's, then the blocks'


def capture_after_nothing(model: torch.nn.Module, inputs: tuple, session: CaptureSession, training: bool,
                          breaks: tuple) -> tuple | None:
    """Where dynamo on the forward captured nothing (``breaks``: why): (runner, how, graph breaks)
    from dynamo over the forward's torch.fx trace, else from the blocks one by one; or None."""
    return capture_from_trace(model, inputs, session, training, breaks) or \
        capture_blockwise(model, inputs, session, training, breaks)
