"""The pass-authoring API: a pass rewrites an FX graph and says whether and why.

Its cost effect is never written by hand: the pipeline lowers the graph before and
after the pass to a task graph and simulates both (see fxdream.sim).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence, runtime_checkable

import torch
import torch.fx as fx


@dataclass(frozen=True)
class PassContext:
    """What a pass may look at to decide: where it runs, training or not, which graph.

    ``params`` maps forward placeholders to the model's live parameters and buffers.
    In inference (``frozen``) a pass may treat them as constants (fold BatchNorm,
    prepack weights), as inductor's freezing does: later in-place edits of the weights
    are then not seen by the optimized module. ``predict_us(gm)`` simulates one graph
    with the pipeline's cost model, so a pass can compare its candidate rewrites.
    ``forced`` is True when the user named the pass, False under ``passes="auto"``: a
    pass that is not forced should decline when its rewrite is not predicted to help.
    """
    device: str = "cpu"            # where the module runs: "cpu" | "cuda"
    training: bool = False
    phase: str = "fw"              # "fw" | "bw"
    sim_device: str | None = None  # DeviceSpec name to predict for (defaults to device)
    memory_budget: int | None = None
    cost_model: object | None = None
    params: Mapping[str, torch.Tensor] = field(default_factory=dict)
    predict_us: Callable[[fx.GraphModule], float] | None = None
    forced: bool = True            # named explicitly: apply even without a predicted gain

    @property
    def frozen(self) -> bool:
        return not self.training and self.phase == "fw"


@dataclass(frozen=True)
class PassResult:
    graph_module: fx.GraphModule
    modified: bool
    reason: str
    notes: tuple = ()


@runtime_checkable
class Pass(Protocol):
    name: str

    def applies_to(self, ctx: PassContext) -> str | None:
        """None when the pass applies in this context, else the reason it does not."""

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        ...


_REGISTRY: dict[str, Pass] = {}


def register_pass(pass_or_class):
    """Register a pass (an instance, or a class with a no-argument constructor) by its name."""
    instance = pass_or_class() if isinstance(pass_or_class, type) else pass_or_class
    if not isinstance(instance, Pass):
        raise TypeError(f"{pass_or_class!r} is not a pass: it needs a name, applies_to(ctx) and __call__(gm, ctx)")
    _REGISTRY[instance.name] = instance
    return pass_or_class


def available_passes() -> tuple[str, ...]:
    """Registered pass names in the order ``passes="auto"`` runs them: by the pass's ``order``
    (default 0; passes that schedule the final kernels, as ``cuda_graphs`` and
    ``aux_stream_backward`` do, set a higher one and run after the rewrites), then by name.
    A pass with ``final = True`` (``reinplace``) is not part of the subsets ``auto`` compares:
    it runs once on the chosen graph and stays only if that is predicted faster."""
    _load_builtin_passes()
    return tuple(sorted(_REGISTRY, key=lambda name: (getattr(_REGISTRY[name], "order", 0), name)))


def resolve_passes(passes) -> tuple[Pass, ...]:
    """Names or Pass objects → Pass objects; an unknown name is a ValueError listing the valid ones."""
    if passes is None:
        return ()
    if passes == "auto":
        return tuple(_REGISTRY[name] for name in available_passes())
    if isinstance(passes, str):
        passes = [p for p in passes.split(",") if p]
    if not isinstance(passes, Sequence):
        raise TypeError(f"passes must be a list of pass names or Pass objects, got {type(passes).__name__}")
    resolved = []
    for item in passes:
        if isinstance(item, str):
            _load_builtin_passes()
            if item not in _REGISTRY:
                valid = ", ".join(sorted(_REGISTRY)) or "(none registered)"
                raise ValueError(f"unknown pass {item!r}; valid passes: {valid}")
            resolved.append(_REGISTRY[item])
        elif isinstance(item, Pass):
            resolved.append(item)
        else:
            raise TypeError(f"passes entries must be pass names or Pass objects, got {type(item).__name__}")
    return tuple(resolved)


def _load_builtin_passes() -> None:
    """Importing fxdream.passes registers the built-in passes (each file registers itself)."""
    import fxdream.passes  # noqa: F401
