"""Everything a pass author needs, from one module: the context a pass decides in, the result
it returns, the base class that declares where it applies, ``choose`` for comparing rewrites,
notes, registration, and the graph helpers most passes use.

A pass rewrites an FX graph and says whether and why. Its cost effect is never written by
hand: the pipeline lowers the graph before and after the pass to a task graph and simulates
both (see fxdream.sim), and checks that every node the pass added carries ``meta["val"]`` and
``meta["layer"]``, which that simulation reads.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Callable, ClassVar, Mapping, Protocol, Sequence, runtime_checkable

import torch
import torch.fx as fx

from fxdream.ir.graphs import attribute_of, copy_graph_module
from fxdream.ir.nodes import LAYER, PHASE, fake_value, op_name, value_of
from fxdream.ir.tensors import real_tensors

__all__ = [
    "PassContext", "PassResult", "PassBase", "Pass", "Note", "Choice", "choose", "register_pass",
    "registered_passes", "complete_new_nodes", "frozen_value", "kept_if_faster",
    # the graph helpers most passes use
    "copy_graph_module", "LAYER", "PHASE", "op_name", "value_of", "fake_value", "real_tensors",
]


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
    ``forward``, for a backward graph, is the forward graph it follows in a step (as rewritten):
    on a GPU the backward's host work starts while the forward's kernels still run, so a backward
    is predicted after it (``sim.prediction.step_prediction``), never from a standing start.
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
    forward: fx.GraphModule | None = None  # a backward graph's forward in its step

    @property
    def frozen(self) -> bool:
        return not self.training and self.phase == "fw"


class Note(str):
    """One note of a pass about one place, kept as a record: ``subject`` (a layer, node or
    variant; "" for the whole graph), ``kind`` (a short category a pass counts by, such as
    "skipped"; "" for none), ``detail`` (what happened there). It reads as its text, the
    non-empty fields joined by ": " ("layer1.0.conv1: skipped: grouped"), so a report prints it
    and a test compares it as the string it shows; code reads the fields, never the text."""

    def __new__(cls, subject: str, detail: str, kind: str = "") -> "Note":
        note = super().__new__(cls, ": ".join(part for part in (subject, kind, detail) if part))
        object.__setattr__(note, "subject", subject)
        object.__setattr__(note, "detail", detail)
        object.__setattr__(note, "kind", kind)
        return note

    def __setattr__(self, name, value):
        raise AttributeError("a Note is immutable")

    def __reduce__(self):
        return (Note, (self.subject, self.detail, self.kind))


@dataclass(frozen=True)
class PassResult:
    """What a pass returns: the graph to run next, whether it changed, why, and its notes."""
    graph_module: fx.GraphModule
    modified: bool
    reason: str
    notes: tuple = ()

    @classmethod
    def unchanged(cls, gm: fx.GraphModule, reason: str, notes: Sequence = ()) -> "PassResult":
        """The pass left ``gm`` as it was (declined, or found nothing to do), and why."""
        return cls(gm, False, reason, tuple(notes))

    @classmethod
    def changed(cls, gm: fx.GraphModule, reason: str, notes: Sequence = ()) -> "PassResult":
        """The pass rewrote the graph into ``gm``; ``reason`` says what it did."""
        return cls(gm, True, reason, tuple(notes))


@dataclass(frozen=True)
class Choice:
    """The outcome of ``choose``: the chosen candidate's key (None: keep the baseline), the
    predicted µs of the baseline and of each candidate, and whether the choice was forced (a
    named pass applies its fastest candidate even where that is not predicted faster)."""
    chosen: object
    baseline_us: float
    predicted_us: Mapping[object, float]
    forced: bool = False

    @property
    def speedup(self) -> float:
        """Baseline time over the chosen candidate's (1.0 where the baseline is kept)."""
        return 1.0 if self.chosen is None else self.baseline_us / self.predicted_us[self.chosen]


def choose(ctx: "PassContext", baseline, candidates: Mapping[object, object]) -> Choice:
    """The rule every pass that compares rewrites follows: named (``ctx.forced``), apply the
    candidate predicted fastest; under ``passes="auto"``, apply it only if it is predicted faster
    than ``baseline``, else keep the baseline. ``baseline`` and the candidates' values are graph
    modules (predicted here with ``ctx.predict_us``) or predicted µs already known."""
    base_us = _predicted_us(ctx, baseline)
    times = {key: _predicted_us(ctx, value) for key, value in candidates.items()}
    best = min(times, key=times.get) if times else None
    if best is None:
        return Choice(None, base_us, times)
    faster = times[best] < base_us
    if not faster and not ctx.forced:
        return Choice(None, base_us, times)
    return Choice(best, base_us, times, forced=not faster)


def kept_if_faster(ctx: "PassContext", original: fx.GraphModule | None, rewritten: fx.GraphModule, what: str,
                   notes: Sequence = ()) -> PassResult:
    """The result of a pass with one rewrite: ``choose`` between ``original`` (the graph before,
    kept unchanged) and ``rewritten``, the predicted times in the reason ("predicted: 0.100 →
    0.050 ms", ", forced: not faster" where named and slower); without a cost model
    (``ctx.predict_us`` None, ``original`` may be None) the rewrite applies."""
    if ctx.predict_us is None:
        return PassResult.changed(rewritten, what, notes)
    choice = choose(ctx, original, {"rewritten": rewritten})
    listing = f"predicted: {choice.baseline_us / 1e3:.3f} → {choice.predicted_us['rewritten'] / 1e3:.3f} ms"
    if choice.chosen is None:
        return PassResult.unchanged(original, f"not faster in context ({listing})", notes)
    return PassResult.changed(rewritten, f"{what} ({listing}{', forced: not faster' if choice.forced else ''})", notes)


def _predicted_us(ctx: "PassContext", graph_or_us) -> float:
    if isinstance(graph_or_us, fx.GraphModule):
        if ctx.predict_us is None:
            raise ValueError("choose() needs ctx.predict_us (a cost model) to predict a graph")
        return ctx.predict_us(graph_or_us)
    return float(graph_or_us)


@runtime_checkable
class Pass(Protocol):
    name: str

    def applies_to(self, ctx: PassContext) -> str | None:
        """None when the pass applies in this context, else the reason it does not."""

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        ...


class PassBase:
    """A pass declares where it applies; ``applies_to`` is derived from the declaration.

    Class attributes: ``name``; ``devices`` ("cpu", "cuda"), ``modes`` ("inference",
    "training") and ``phases`` ("fw", "bw") it rewrites; ``why_not``, the sentence the report
    gives when the device, mode or phase is not one of them (keys "device", "mode", "phase";
    ``{device}`` is filled in); ``order`` (``passes="auto"`` runs passes by it, then by name: a
    pass scheduling the final kernels sets a higher one); ``final`` (True: not part of the
    subsets ``auto`` compares, run once on the chosen graph); ``changes_numerics`` (True: results
    differ from float32's beyond rounding, so ``auto`` never picks it); ``alone`` (True: ``auto`` compares
    it as an alternative of its own, run on the graph as captured and never combined with the other
    passes: it replaces what they rewrite). ``requires(ctx)`` adds a condition
    the declaration cannot say (a library this torch lacks). A subclass implements ``__call__``.
    """
    name: ClassVar[str]
    devices: ClassVar[tuple[str, ...]] = ("cpu", "cuda")
    modes: ClassVar[tuple[str, ...]] = ("inference", "training")
    phases: ClassVar[tuple[str, ...]] = ("fw", "bw")
    why_not: ClassVar[Mapping[str, str]] = MappingProxyType({})
    order: ClassVar[int] = 0
    final: ClassVar[bool] = False
    changes_numerics: ClassVar[bool] = False
    alone: ClassVar[bool] = False

    def applies_to(self, ctx: PassContext) -> str | None:
        """None when the pass applies in ``ctx``, else the reason it does not: the device, then
        the mode, then the phase, then ``requires``."""
        mode = "training" if ctx.training else "inference"
        for what, given, allowed in (("device", ctx.device, self.devices), ("mode", mode, self.modes),
                                     ("phase", ctx.phase, self.phases)):
            if given not in allowed:
                default = f"{what} {given!r} is not one this pass rewrites ({', '.join(allowed)})"
                return self.why_not.get(what, default).format(device=ctx.device)
        return self.requires(ctx)

    def requires(self, ctx: PassContext) -> str | None:
        """A further condition for applying in ``ctx``: None when met, else the reason."""
        return None

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        raise NotImplementedError(f"{type(self).__name__} must implement __call__(gm, ctx)")


def frozen_value(node, ctx: PassContext) -> torch.Tensor | None:
    """The tensor of a constant a pass may fold, cast or pack in inference (``ctx.frozen``): a
    parameter or buffer placeholder (``ctx.params``), or a ``get_attr`` constant of the graph (a
    dynamo capture's parameters, an earlier pass's weights); None for anything else."""
    if not isinstance(node, fx.Node) or not ctx.frozen:
        return None
    if node.op == "get_attr":
        value = attribute_of(node.graph.owning_module, node.target)
        return value if isinstance(value, torch.Tensor) else None
    return ctx.params.get(node.name) if node.op == "placeholder" else None


def complete_new_nodes(before: fx.GraphModule, after: fx.GraphModule) -> list[str]:
    """Give the ops ``after`` has that ``before`` has not (by name) what the simulator reads,
    where the pass left it out: ``meta["layer"]`` from the first input that has one, and
    ``meta["val"]`` recomputed from the inputs' fake tensors (``fake_value``). Returns a line for
    each new op whose value is still unknown: it would be costed as 0 bytes, the pass look free."""
    known = {n.name for n in before.graph.nodes}
    missing = []
    for node in after.graph.nodes:
        if node.name in known or node.op != "call_function":
            continue
        if LAYER not in node.meta:
            node.meta[LAYER] = next((a.meta[LAYER] for a in node.all_input_nodes if LAYER in a.meta), "")
        if "val" not in node.meta and any(hasattr(a.meta.get("val"), "fake_mode") for a in node.all_input_nodes):
            try:
                node.meta["val"] = fake_value(node)
            except Exception:  # an op its inputs' fake tensors cannot run: listed below
                pass
        if "val" not in node.meta:
            missing.append(f"{node.name} ({getattr(node.target, '__name__', node.target)}) has no meta['val']")
    return missing


_REGISTRY: dict[str, Pass] = {}


def register_pass(pass_or_class):
    """Register a pass (an instance, or a class with a no-argument constructor) by its name."""
    instance = pass_or_class() if isinstance(pass_or_class, type) else pass_or_class
    if not isinstance(instance, Pass):
        raise TypeError(f"{pass_or_class!r} is not a pass: it needs a name, applies_to(ctx) and __call__(gm, ctx)")
    _REGISTRY[instance.name] = instance
    return pass_or_class


def registered_passes() -> Mapping[str, Pass]:
    """Every registered pass by name (a read-only view: ``register_pass`` adds to it)."""
    return MappingProxyType(_REGISTRY)


