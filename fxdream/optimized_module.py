"""The module optimize() returns: the compiled model, its report, and how it is called."""
from __future__ import annotations

import copy
import dataclasses
import inspect
import itertools
import re
import warnings
from typing import Callable

import torch
import torch.utils.checkpoint

from fxdream.capturing.arguments import positional_call
from fxdream.capturing.dynamo import describe_error, raised_compiling, recompile_limit_notes
from fxdream.capturing.keywords import WithKeywords, user_model
from fxdream.capturing.session import CaptureSession
from fxdream.capturing.traced_runner import autocast_enabled
from fxdream.pass_runner import PassPipeline
from fxdream.report import GraphReport, Report

# Exceptions torch raises through a forward on purpose, to be caught by its own caller: never a
# failure of the rewritten graphs (checkpoint's recomputation stops a replayed forward so, once it
# has the activations it needs). Falling back to eager on one would run the forward a second time.
TORCH_CONTROL_FLOW = (torch.utils.checkpoint._StopRecomputationError,)
RECOMPILE_LIMIT = 3  # compilations of calls alike (the build's included) before running eagerly


def call_kind(args: tuple, kwargs: dict, grad: bool, training: bool) -> tuple:
    """What makes two calls alike for dynamo with static shapes: how the arguments are passed
    (positional or by keyword), tensors' shapes, strides, dtypes and devices, other values as
    they are (their types, where they cannot be hashed), grad mode, the train/eval flag and
    whether autocast is on. Strides and keywords count: dynamo compiles a channels_last call, or
    one by keyword, apart from a plain one, and those are new kinds of call, not recompiles."""
    def leaf(x):
        if isinstance(x, torch.Tensor):
            return (tuple(x.shape), x.stride(), x.dtype, x.device, x.requires_grad)
        if isinstance(x, (int, float, bool, str, type(None))):
            return x
        return (type(x), *(tuple(t.shape) for t in held_tensors(x)))
    leaves, structure = torch.utils._pytree.tree_flatten((args, kwargs))
    return (structure, *(leaf(x) for x in leaves), grad, training, autocast_enabled())


# held_tensors: how deep it looks into an object, how many tensors it reads, how many values it visits
HELD_DEPTH, HELD_MOST, HELD_VISITS = 4, 256, 4096
_NO_TENSORS = (int, float, complex, bool, str, bytes, type, type(None))  # values that hold no tensor


def held_tensors(value, depth: int = HELD_DEPTH) -> list[torch.Tensor]:
    """The tensors an object pytree does not open holds in its attributes, lists, tuples and
    dicts (a Hugging Face KV cache's keys and values, which grow by a token each decoding step:
    each step a new shape for dynamo, not a recompile of one kind of call); at most
    ``HELD_MOST``, ``depth`` levels down, of the first ``HELD_VISITS`` values it meets (a call's
    cost stays small beside an object holding a long list of numbers)."""
    found, stack, seen, visits = [], [(value, depth)], set(), 0
    while stack and len(found) < HELD_MOST and visits < HELD_VISITS:
        item, left = stack.pop()
        visits += 1
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif left and id(item) not in seen:
            seen.add(id(item))
            children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) \
                else getattr(item, "__dict__", {}).values()
            held = [child for child in itertools.islice(children, HELD_VISITS) if not isinstance(child, _NO_TENSORS)]
            stack.extend((child, left - 1) for child in reversed(held))
    return found


class PositionalCalls(torch.nn.Module):
    """An ``OptimizedModule`` built with keywords that have no position, called with the capture's
    positional tuple: the tensor keywords passed back by name, the bound flags with them."""

    def __init__(self, module: "OptimizedModule"):
        super().__init__()
        self.module = module

    @property
    def model(self) -> torch.nn.Module:
        return self.module.model

    def forward(self, *args):
        args, kwargs = self.module.model.as_called(args)
        return self.module(*args, **kwargs)


class OptimizedModule(torch.nn.Module):
    """The model, run through its captured (and rewritten) graphs. ``.report`` says how.

    Built by ``fxdream.optimize``: the constructor takes what the capture found (``capture``: the
    path that took the model; ``graph_breaks``; ``fallback_reason``: why it runs eagerly, or
    None), and the build adds what it checks afterwards through ``_note``, ``_record`` and
    ``_finish``, the only methods that change a built module's state besides its own calls."""

    def __init__(self, model: torch.nn.Module, runner: Callable, session: CaptureSession,
                 pipeline: PassPipeline, training: bool, device: torch.device, strict: bool,
                 capture: str = "dynamo", graph_breaks: tuple[str, ...] = (), fallback_reason: str | None = None):
        super().__init__()
        self.model = model
        self.training = model.training  # as torch.compile's module mirrors it
        # The compiled runner wraps ``model``; keep it out of the module tree (no duplicate params).
        self.__dict__["_runner"] = runner
        self.__dict__["_session"] = session
        self.__dict__["_pipeline"] = pipeline
        self._inference = not training
        self._device = device
        self._strict = strict
        self._graph_breaks = tuple(graph_breaks)
        self._fallback_reason = fallback_reason
        self._build_seconds = 0.0
        self._capture = capture
        self._rebuild: Callable[[torch.nn.Module], "OptimizedModule"] | None = None
        self._extras: dict = {}  # whole-model predictions, verification, measurements
        # call signature → (compilations for it call after call, then ``_calls`` at the last of them)
        self._compilations: dict[tuple, tuple[int, int, int]] = {}
        self._compiled_codes: dict[tuple, set] = {}  # call signature → functions compiled for it
        self.__dict__["_calls"] = [0, 0]  # calls, calls that compiled (a list: no Module.__setattr__ per call)

    def forward(self, *args, **kwargs):
        if torch.compiler.is_compiling():  # inside another capture (a model holding this one): the model's
            return user_model(self.model)(*args, **kwargs)  # own ops, captured with the rest, as torch.compile's
        if self._fallback_reason is not None:
            return self._call(user_model(self.model), args, kwargs)
        if isinstance(self.model, WithKeywords):  # built with keywords that have no position
            placed = self.model.place(args, kwargs)
            if placed is None:  # a call without them, or with other values: the model as it is
                return self._call(self.model.model, args, kwargs)
            args, kwargs = placed, {}
        elif kwargs:  # by keyword as by position: the call the capture saw (positional_call)
            try:
                args, kwargs = positional_call(self.model.forward, args, kwargs, self._forward_signature()), {}
            except (TypeError, ValueError):  # a keyword forward's signature does not place: passed on as it is
                pass
        compiled = len(self._session.records)
        self._calls[0] += 1
        try:
            output = self._call(self._runner, args, kwargs)
        except TORCH_CONTROL_FLOW:
            raise
        except Exception as error:
            compiling = raised_compiling(error)
            if self._strict or not (compiling or any(row.applied for row in self._pipeline.rows)):
                raise
            output = self._call(self.model, args, kwargs)  # raises too where the call itself is wrong
            self._fall_back(f"compilation failed on a later call: {describe_error(error)}" if compiling else
                            f"the rewritten graphs raised on a later call where eager did not "
                            f"({describe_error(error)})")
            return output
        if len(self._session.records) > compiled:
            key = call_kind(args, kwargs, torch.is_grad_enabled() and not self._inference, self.model.training)
            self._count_compilation(key, self._session.records[compiled:])
            self._session.forget_real_tensors()
        return output

    def called_positionally(self) -> torch.nn.Module:
        """This module called as its capture takes a call: one positional tuple, the tensors of
        keywords without a position (``WithKeywords``) last; itself where there are none. fxdream's
        own checks and timings hold the call in that form, and run the model (``self.model``) on it."""
        return PositionalCalls(self) if isinstance(self.model, WithKeywords) else self

    def _forward_signature(self) -> inspect.Signature:
        """The model's forward signature, read once: a model called by keyword places every call."""
        if "_signature" not in self.__dict__:
            self.__dict__["_signature"] = inspect.signature(self.model.forward)
        return self.__dict__["_signature"]

    def __getattr__(self, name: str):
        """The model's own attributes where this module has none (``config``, ``generate``, a
        submodule by name), as ``torch.compile``'s module passes them through: a method called
        so runs the model itself, eagerly (``generate`` calls the model's forward, not this one)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            model = self.__dict__.get("_modules", {}).get("model")
            if model is None or name.startswith("__"):
                raise
            try:
                return getattr(user_model(model), name)
            except AttributeError:
                raise AttributeError(f"'{type(self).__name__}' object has no attribute {name!r}, nor has the "
                                     f"{type(user_model(model)).__name__} it was built from") from None

    def __deepcopy__(self, memo) -> "OptimizedModule":
        """The same build of a deep copy of the model: the graphs run on this model's own tensors
        (the torch.fx path's are bound at compile time) and on oneDNN-packed constants, which
        cannot be copied; a copy of the graphs would read the original's weights or fail. The
        copy's submodules take this module's train/eval flags as they are now (``fast.eval()``
        after a training build), as ``copy.deepcopy`` of the model keeps them, not the build's."""
        rebuilt = self._rebuild(copy.deepcopy(self.model, memo))
        flags = [(copied, original.training) for copied, original in zip(rebuilt.modules(), self.modules())
                 if copied.training != original.training]
        for copied, training in flags:
            copied.training = training
        if flags:
            rebuilt._note("a copy (copy.deepcopy) of a module whose train/eval flags changed after its build: "
                          "built as that build was, then given the flags the original has now")
        return rebuilt

    def __reduce__(self):
        raise TypeError("an fxdream OptimizedModule cannot be pickled (its graphs are compiled code bound to "
                        "this process): save the model (torch.save(optimized.model.state_dict())) and build "
                        "again after loading it")

    def _count_compilation(self, key: tuple, records: list) -> None:
        """Run eagerly once dynamo has compiled calls of one kind (``key``: ``call_kind``)
        ``RECOMPILE_LIMIT`` times with no call between that did not compile: a guard on something
        that changes every call (a counter the forward increments) recompiles on every call, each
        time running the passes again, up to dynamo's recompile limit. Compilations calls apart (a
        layer unfrozen, BatchNorm put in eval mid-training) start the count again. A call that
        compiled only functions not compiled for its kind before (the code after a data-dependent
        branch, compiled when a call first takes it) is not counted."""
        self._calls[1] += 1
        codes = self._compiled_codes.setdefault(key, set())
        again = any(r.code in codes for r in records)
        codes.update(r.code for r in records)
        if not again and key in self._compilations:
            return
        calls, compiling = self._calls
        previous = self._compilations.get(key)
        every_call = previous is not None and calls - previous[1] == compiling - previous[2]
        count = previous[0] + 1 if every_call else 1
        self._compilations[key] = (count, calls, compiling)
        if count >= RECOMPILE_LIMIT and not self._strict:
            self._fall_back(f"dynamo compiled calls with the same input shapes {count} times in a row: something "
                            f"its guards check changes on every call (a Python number the forward updates, such "
                            f"as a call counter, or a tensor's value read as a number), and each compilation "
                            f"runs the passes again")

    @property
    def _cost_model(self):
        """The cost model the passes were judged with (None: no predictions)."""
        return self._pipeline.base_context.cost_model

    def _note(self, text: str, first: bool = False) -> None:
        """A line for the report's notes (``first``: before the capture's own)."""
        self._session.notes.insert(0, text) if first else self._session.notes.append(text)

    def _record(self, **results) -> None:
        """Results of the build's checks (predictions, verification, timings) for the report."""
        self._extras.update(results)

    def _mark_disturbed(self, why: str) -> None:
        """The build measured while other work ran: said in the report, and every pass decision
        made on predictions marked."""
        self._extras["measurements_disturbed"] = why
        self._pipeline.rows[:] = [
            dataclasses.replace(r, reason=f"{r.reason} [decided on measurements taken while the machine was busy]")
            if r.predicted_delta_us is not None or r.name == "auto" else r for r in self._pipeline.rows]

    def _finish(self, build_seconds: float, rebuild: Callable[[torch.nn.Module], "OptimizedModule"]) -> None:
        """The build's time, and how to build the same for another model (``copy.deepcopy``); the
        model's tensors left free to be swapped (``CaptureSession.forget_real_tensors``)."""
        self._build_seconds = build_seconds
        self._rebuild = rebuild
        self._session.forget_real_tensors()

    def _call(self, fn: Callable, args, kwargs):
        if self._inference:
            if torch.is_grad_enabled() and "_warned_no_grad" not in self.__dict__ and _requires_grad(args, kwargs):
                self.__dict__["_warned_no_grad"] = True
                warnings.warn("this module was built for inference (optimize(..., training=False)) and runs under "
                              "torch.no_grad(): its outputs carry no gradient, though an input requires one; for "
                              "gradients with respect to inputs build with training=True, then call .eval() on "
                              "the built module", stacklevel=5)  # the caller of the module
            with torch.no_grad():
                return fn(*args, **kwargs)
        return fn(*args, **kwargs)

    def _fall_back(self, reason: str) -> None:
        self._fallback_reason = reason

    @property
    def report(self) -> Report:
        """A snapshot of what was captured and what the passes did (complete after one step)."""
        captured = self._session.captured()
        notes = [*self._session.notes, *recompile_limit_notes(self._session)]
        extras = dict(self._extras, notes=per_graph_notes_folded(notes) + tuple(self._extras.get("notes", ())))
        return Report(model=type(user_model(self.model)).__name__, training=not self._inference,
                      device=str(self._device), graphs=_graphs_with_ops(captured),
                      graph_breaks=self._graph_breaks, fallback_reason=self._fallback_reason,
                      passes=tuple(self._pipeline.rows), build_seconds=self._build_seconds,
                      capture=self._capture, **extras)

    @property
    def captured(self):
        """The ``Captured`` graphs (as captured, before passes) of every subgraph so far."""
        return self._session.captured()

    @property
    def rewritten_graphs(self) -> dict:
        """(subgraph index, phase) → the graph the passes produced (absent: ran as captured)."""
        return dict(self._pipeline.rewritten)


_GRAPH_NOTE = re.compile(r"graph (\d+): (.*)", re.DOTALL)


def per_graph_notes_folded(notes) -> tuple[str, ...]:
    """Notes that say the same of several graphs ("graph 3: dropped 5 copies ...", one per graph a
    new input shape compiled) once, naming the graphs ("graphs 0, 3, 4: ..."), where the first
    of them stood; other notes as they are."""
    graphs: dict[str, list[str]] = {}
    for note in notes:
        match = _GRAPH_NOTE.fullmatch(note)
        if match:
            graphs.setdefault(match.group(2), []).append(match.group(1))
    folded, said = [], set()
    for note in notes:
        match = _GRAPH_NOTE.fullmatch(note)
        if match is None:
            folded.append(note)
        elif match.group(2) not in said:
            said.add(match.group(2))
            indices = graphs[match.group(2)]
            folded.append(note if len(indices) == 1 else f"graphs {', '.join(indices)}: {match.group(2)}")
    return tuple(folded)


def _requires_grad(args, kwargs) -> bool:
    return any(isinstance(value, torch.Tensor) and value.requires_grad for value in (*args, *kwargs.values()))


def _graphs_with_ops(captured) -> tuple[GraphReport, ...]:
    """The report's subgraphs: those that compute something (dynamo can hand the backend a graph
    of no op, between two breaks, which runs nothing)."""
    return tuple(g for g in map(GraphReport.of, captured) if g.forward_ops or g.backward_ops)
