"""When neither dynamo nor torch.fx captures a model's forward: capture its blocks one by one.

Dynamo gives up on a whole function at a graph break it cannot resume after (a data-dependent
``if float(x.mean()) > 10`` inside the loop over the blocks), and torch.fx cannot trace such a
forward either, so the model used to run wholly eagerly. Its blocks usually trace: each direct
child module (for a ModuleList or ModuleDict, each of its elements) is compiled through the
capture session, and the forward runs as written, eagerly, calling the compiled blocks. The
model is not changed: the compiled calls are installed in ``_compiled_call_impl`` (what
``nn.Module.compile`` sets) only for the duration of each call.
"""
from __future__ import annotations

import types

import torch

from .capture import CaptureSession, run_once
from .dynamo_glue import graph_break_counts, new_graph_breaks


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules the forward calls directly: its children, a container's elements instead of it."""
    found = []
    for child in model.children():
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            found.extend(child.children())  # a container is not called; its elements are
        else:
            found.append(child)
    return [b for b in found if getattr(b, "_compiled_call_impl", None) is None]  # not compiled already


class BlockwiseRunner:
    """Calls the model eagerly with each of its blocks compiled through ``session``."""

    def __init__(self, model: torch.nn.Module, session: CaptureSession):
        self._model = model
        self._blocks = blocks(model)
        self._compiled = [_compiled_call(b, i, session) for i, b in enumerate(self._blocks)]

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
    hooks included (compiling ``block`` itself ran its forward without its hooks; compiling
    ``block._call_impl``, as ``nn.Module.compile`` does, captured nothing for ``nn.Sequential``:
    dynamo skips frames in torch.nn's own files)."""

    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        return self.block(*args, **kwargs)


def _own_call(block: torch.nn.Module, index: int) -> _Call:
    """A ``_Call`` whose forward has a code object of its own: dynamo keeps its compiled graphs
    per code object and does not guard on hooks, so blocks of one class shared the graph of the
    first one traced, and a forward hook on another block never ran. One graph per block also
    lets an inference rewrite take each block's weights as constants."""
    code = _Call.forward.__code__
    names = {"co_name": f"block_{index}"} | ({"co_qualname": f"block_{index}"} if hasattr(code, "co_qualname") else {})
    code = code.replace(**names)  # co_qualname: Python 3.11 and later
    forward = types.FunctionType(code, _Call.forward.__globals__, code.co_name)
    return type(f"_Call{index}", (_Call,), {"forward": forward})(block)


def _compiled_call(block: torch.nn.Module, index: int, session: CaptureSession):
    """``block``'s call through dynamo with ``session``, for ``block._compiled_call_impl``; while
    it runs the slot is empty, so that the block's own ``__call__`` does not come back here."""
    compiled = torch.compile(_own_call(block, index), backend=session, dynamic=False)

    def call(*args, **kwargs):
        block._compiled_call_impl = None
        try:
            return compiled(*args, **kwargs)
        finally:
            block._compiled_call_impl = call
    return call


def capture_blockwise(model: torch.nn.Module, inputs: tuple, session: CaptureSession, training: bool,
                      breaks: tuple) -> tuple[BlockwiseRunner, str, tuple] | None:
    """(runner, how, graph breaks) capturing ``model``'s blocks, or None where that captures
    nothing (no blocks, or none of them traces)."""
    runner = BlockwiseRunner(model, session)
    if not len(runner):
        return None
    breaks_before, records = graph_break_counts(), len(session.records)
    try:
        run_once(runner, model, inputs, training)
    except Exception:  # a last chance only: the caller reports the first failure
        del session.records[records:]
        return None
    if not session.captured():
        return None
    why = "; ".join(b.rstrip(".") for b in breaks) or "no graph"
    return (runner, f"dynamo per block, the forward eager ({len(runner)} child modules; neither dynamo "
            f"on forward nor torch.fx captured it: {why})", new_graph_breaks(breaks_before))
