"""What stands between an inference graph's rewrite and the call: each wrapper runs the rewritten
graph while it is right for the call, and the graph as captured (``original``) otherwise."""
from __future__ import annotations

import operator
from typing import Callable

import torch


def tensor_version(t: torch.Tensor) -> int | None:
    """``t._version`` (bumped by every in-place update); None for an inference tensor (made under
    ``torch.inference_mode()``), which keeps no version counter and raises when asked."""
    return None if t.is_inference() else t._version


_VERSION = operator.attrgetter("_version")


def same_state_or(rewritten: Callable, original: Callable, state: list, own: int) -> Callable:
    """Run ``rewritten`` while the model state dynamo passes in is what it was rewritten for.

    dynamo lifts a module's parameters to graph inputs, so one graph serves every instance of a
    class (two blocks of the same type, called in a loop dynamo gave up on). A rewrite that took
    them as constants (BatchNorm folded, weights prepacked) is right for the first instance
    only: for any other state, the graph as captured runs instead."""
    lifted = tuple((i, t) for i, t in enumerate(state) if i >= own and t is not None)
    if not lifted:
        return rewritten

    def run(*args):
        if all(args[i] is t for i, t in lifted):
            return rewritten(*args)
        return original(*args)
    return run


def weights_as_built_or(rewritten: Callable, original: Callable, state: list, changed: Callable) -> Callable:
    """Run ``rewritten`` while the model tensors it may hold as constants (BatchNorm folded,
    weights packed) are as they were built from; once one was updated in place, or given other
    memory (``module.half()``, ``.to()``, ``param.data = ...``, which keep the version),
    ``original`` (the graph as captured, which reads them at every call), and ``changed()`` says
    so. Asking every tensor's version and address costs host time on every call, in proportion
    to their number: asked through ``map`` (a C loop), not a Python one per tensor. A layout
    without an address of its data (a sparse tensor's) is watched by its version only."""
    watched = [t for t in state if t is not None and tensor_version(t) is not None]
    strided = [t for t in watched if t.layout is torch.strided]
    built_versions, built_addresses = list(map(_VERSION, watched)), list(map(torch.Tensor.data_ptr, strided))
    stale = []

    def run(*args):
        if not stale:
            if (list(map(_VERSION, watched)) == built_versions
                    and list(map(torch.Tensor.data_ptr, strided)) == built_addresses):
                return rewritten(*args)
            stale.append(True)
            changed()
        return original(*args)
    return run


def captured_if_rewrite_raises(rewritten: Callable, original: Callable, failed: Callable) -> Callable:
    """Run ``rewritten`` until a call raises where ``original`` (the graph as captured) does not;
    from then on ``original``, and ``failed(error)`` says why. For inference graphs: they write
    no input (aot_autograd applies input mutations after the graph), so a call that raised
    halfway can run again. Under ``torch.compile(backend="fxdream")`` nothing else stands
    between a broken rewrite and the user's call."""
    broken = []

    def run(*args):
        if not broken:
            try:
                return rewritten(*args)
            except Exception as error:
                out = original(*args)  # raises here where the call itself is wrong
                broken.append(error)
                failed(error)
                return out
        return original(*args)
    return run
