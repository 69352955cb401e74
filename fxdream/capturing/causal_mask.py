"""Transformer layers given a mask, in a capture whose graphs are only analysed.

``nn.TransformerEncoder`` and ``nn.TransformerDecoder`` ask whether a mask they are given is
causal by reading its values (``torch.nn.modules.transformer._detect_is_causal_mask``:
``bool((mask == causal).all())``), and dynamo breaks the graph there, inside torch's own code,
whose frames it does not compile: the whole ``nn.Transformer`` runs eagerly, in no graph, and
a prediction that measures nothing leaves it out. While such a capture runs
(``fxdream.capture``, a prediction for another device or on the meta device) the check answers
"not causal" without reading: the mask is applied as given. That is exact (the causal hint only
lets the attention skip what the mask zeroes) and predicts the masked attention's kernel, where
eager on a GPU would detect the causal mask and run the causal one.

Only there: a module that runs (``optimize``) keeps torch's check, since dynamo guards a compiled
frame on the function it inlined and would recompile every call without the stand-in."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from unittest import mock

import torch.nn.modules.transformer as transformer


@dataclass
class MaskChecks:
    """How many times the stand-in answered without reading a mask (a trace may ask more than once)."""
    answered: int = 0

    def note(self) -> tuple[str, ...]:
        if not self.answered:
            return ()
        return ("the masks given to nn.TransformerEncoder/Decoder were taken as not causal without reading them "
                "(torch's check reads their values, which breaks the graph): the attention is predicted with the "
                "mask as given; pass is_causal=True (tgt_is_causal=True) where a mask is causal, for the causal "
                "kernel",)


@contextlib.contextmanager
def causal_checks_unread(active: bool = True):
    """While ``active``: torch's data-reading causal-mask check answers "not causal" for a mask
    given without ``is_causal`` (an explicit ``is_causal`` is kept). Yields the ``MaskChecks``."""
    checks = MaskChecks()
    original = transformer._detect_is_causal_mask
    if not active:
        yield checks
        return

    def unread(mask=None, is_causal=None, size=None):
        if is_causal is None and mask is not None:
            checks.answered += 1
            return False
        return original(mask, is_causal, size)

    with mock.patch.object(transformer, "_detect_is_causal_mask", unread):
        yield checks
