"""The graphs of a recorded step in the order it called them, each call once, with the eager
ops recorded between them (``StepCalls``), as the lowering takes them; the host time between
them as host tasks."""
from __future__ import annotations

import collections

import torch.fx as fx

from fxdream.capturing.host_gaps import END, StepCalls
from fxdream.sim.taskgraph import Task, TaskGraph, TaskKind

EAGER = "eager"  # label prefix of the graph of eager ops recorded between two graph calls
HOST_GAP = "host_gap"  # the op (and name prefix) of the host tasks a measured step's gaps are lowered to


def as_called(by_label: dict, step: StepCalls) -> tuple[list, dict, dict, dict]:
    """(label, graph) per call of ``step`` (calls of graphs not captured here are skipped), each
    preceded by the graphs of the eager ops recorded before it ("eager3.fw", ``eager_before``);
    the host gaps by those labels; by a call's scope ("g0#2"), its layers' renaming
    (``StepCalls.call_layers``, set on its forward and taken by its backward, which pairs with it);
    and the modules each named gap ran, as (name, µs of the gap) (``StepCalls.gap_layers``), by the same labels."""
    forwards = collections.Counter(label.rsplit(".", 1)[0] for label in step.calls if label.endswith(".fw"))
    seen: collections.Counter = collections.Counter()
    used, ordered, gaps, renames = set(), [], {END: step.end_us}, {}
    named = len(step.gap_layers) == len(step.calls) + 1
    in_us = lambda position, us: tuple((name, share * us) for name, share in step.gap_layers[position])  # noqa: E731
    layers = {END: in_us(-1, step.end_us)} if named else {}
    for position, (label, gap_us) in enumerate(zip(step.calls, step.gaps_us)):
        ordered.extend(eager_graphs(step, position))
        if label not in by_label:
            gaps[END] += gap_us
            if named:
                layers[END] += in_us(position, gap_us)
            continue
        scope, phase = label.rsplit(".", 1)
        k = seen[label]
        seen[label] += 1
        if phase == "bw" and forwards[scope]:
            k = max(0, forwards[scope] - 1 - k)  # backward runs its forwards' calls in reverse
        name = label if k == 0 else f"{scope}#{k}.{phase}"
        while name in used:  # more backward than forward calls: never reuse a label
            k += 1
            name = f"{scope}#{k}.{phase}"
        used.add(name)
        ordered.append((name, by_label[label]))
        gaps[name] = gap_us
        if named:
            layers[name] = in_us(position, gap_us)
        if phase == "fw" and position < len(step.call_layers) and step.call_layers[position]:
            renames[name.rsplit(".", 1)[0]] = step.call_layers[position]
    ordered.extend(eager_graphs(step, END))
    return ordered, gaps, renames, {label: modules for label, modules in layers.items() if modules}


def eager_graphs(step: StepCalls, position) -> list[tuple[str, fx.GraphModule]]:
    """(label, graph) of each phase's eager ops recorded before call ``position`` (``END``: after
    the last), in the order they ran: "eager3.fw", "eager3.bw" (a phase again: "eager3_2.fw")."""
    where = f"_{END}" if position == END else str(position)
    labels, seen = [], collections.Counter()
    for phase, gm in step.eager_before.get(position, ()):
        seen[phase] += 1
        labels.append((f"{EAGER}{where}" + (f"_{seen[phase]}" if seen[phase] > 1 else "") + f".{phase}", gm))
    return labels


def append_host_gap(tg: TaskGraph, before: str, us: float, phase: str, modules: tuple = ()) -> None:
    """The host time before a graph call: a task per module that ran in it, (layer, µs of the gap)
    in ``modules``, then one for the rest. A module's call is forward work, whichever graph the gap
    precedes (the loss and autograd's start sit between a model's last module and its backward)."""
    rest = float(us)
    for k, (layer, module_us) in enumerate(modules if us > 0 else ()):
        tg.append(Task(f"{HOST_GAP}:{before}:{k}", TaskKind.CPU, module_us, "cpu:0", op=HOST_GAP, phase="fw",
                       layer=layer))
        rest -= module_us
    if rest > 0:
        tg.append(Task(f"{HOST_GAP}:{before}", TaskKind.CPU, rest, "cpu:0", op=HOST_GAP, phase=phase))
