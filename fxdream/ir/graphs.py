"""Copies of graph modules that a pass may rewrite freely."""
from __future__ import annotations

import copy

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule


def copy_graph_module(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy whose graph a pass may rewrite freely (attributes are shared, not cloned).

    Its Python code is generated when first needed (a call, ``.code``), not here: a pass
    rewrites the copy and recompiles it anyway, and a candidate that is only simulated never
    needs code; code generation costs milliseconds per copy, and a build makes many copies."""
    return _LazyGraphModule(gm, copy.deepcopy(gm.graph), class_name=type(gm).__name__)


def attribute_of(gm: torch.nn.Module, target: str):
    """The module attribute a ``get_attr`` node reads (a dotted path, "layer1.0.weight"), or None."""
    value = gm
    for name in target.split("."):
        value = getattr(value, name, None)
        if value is None:
            return None
    return value
