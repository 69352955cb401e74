"""Pass names as users give them ("auto", a list, "a,b") resolved to the registered passes.

Importing this module imports ``fxdream.passes``, so the built-in passes are registered
before any name is looked up."""
from __future__ import annotations

from typing import Sequence

import fxdream.passes  # noqa: F401  (registers the built-in passes)
from fxdream.pass_api import Pass, registered_passes


def available_passes() -> tuple[str, ...]:
    """Registered pass names in the order ``passes="auto"`` runs them: by the pass's ``order``
    (default 0; passes that schedule the final kernels, as ``cuda_graphs`` and
    ``aux_stream_backward`` do, set a higher one and run after the rewrites), then by name.
    A pass with ``final = True`` (``reinplace``) is not part of the subsets ``auto`` compares:
    it runs once on the chosen graph and stays only if that is predicted faster. A pass that
    changes numerics (``changes_numerics = True``: ``bf16``) is never among them: only named. A
    pass with ``alone = True`` (``onednn_graph``) is compared as an alternative of its own."""
    registered = registered_passes()
    chosen = [name for name in registered if not getattr(registered[name], "changes_numerics", False)]
    return tuple(sorted(chosen, key=lambda name: (getattr(registered[name], "order", 0), name)))


def resolve_passes(passes) -> tuple[Pass, ...]:
    """Names or Pass objects → Pass objects; an unknown name is a ValueError listing the valid ones."""
    if passes is None:
        return ()
    registered = registered_passes()
    if passes == "auto":
        return tuple(registered[name] for name in available_passes())
    if isinstance(passes, str):
        passes = [p for p in passes.split(",") if p]
    if not isinstance(passes, Sequence):
        raise TypeError(f"passes must be a list of pass names or Pass objects, got {type(passes).__name__}")
    resolved = []
    for item in passes:
        if isinstance(item, str):
            if item not in registered:
                valid = ", ".join(sorted(registered)) or "(none registered)"
                raise ValueError(f"unknown pass {item!r}; valid passes: {valid}")
            resolved.append(registered[item])
        elif isinstance(item, Pass):
            resolved.append(item)
        else:
            raise TypeError(f"passes entries must be pass names or Pass objects, got {type(item).__name__}")
    return tuple(resolved)
