"""The gradients a training step makes, and the tasks around each: what data-parallel what-ifs
(DDP, P3) reduce. A captured backward's outputs are found in its graph and placed at the task
that produces each; the gradients of parameters only eager code uses follow them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch.fx as fx

from fxdream.capturing.captured import captured_parts
from fxdream.ir.nodes import is_view
from fxdream.ir.tensors import tensor_bytes
from fxdream.sim.lower import gradient_outputs
from fxdream.sim.taskgraph import TaskGraph, TaskKind
from fxdream.whatif.core import _graphs_by_label, _Start, _through_views, call_scopes


@dataclass(frozen=True)
class Gradient:
    """One gradient the backward returns: its size and the tasks around its production."""
    index: int                 # position among the backward's floating outputs (optimizer order)
    nbytes: int
    producer: str | None       # task after which it exists (a kernel on a GPU); None: an input
    launcher: str | None       # the host task that launched ``producer`` (itself on a CPU)
    position: int              # position in the backward's outputs = forward input position
    consumers: tuple[str, ...] = ()   # forward tasks that read the parameter (for P3)
    graph: str = ""            # the backward's lowering label ("g0.bw")


def gradients(captured, task_graph: TaskGraph, graphs=None) -> tuple[Gradient, ...]:
    """The gradients of every captured backward and the tasks that produce (and, in the
    forward, consume) them in ``task_graph`` (lowered from ``captured``)."""
    by_label, scopes = _graphs_by_label(captured, graphs), call_scopes(task_graph)
    out: list[Gradient] = []
    for c in captured_parts(captured):
        bw = by_label.get(f"g{c.index}.bw")
        if bw is None:
            continue
        fw = by_label[f"g{c.index}.fw"]
        for scope in scopes.get(c.index, [f"g{c.index}"]):  # a graph called per layer: each call's gradients
            out.extend(_call_gradients(fw, bw, f"{scope}.fw", f"{scope}.bw", task_graph, len(out)))
    return tuple(out)


def _call_gradients(fw: fx.GraphModule, bw: fx.GraphModule, flabel: str, blabel: str, task_graph: TaskGraph,
                    first_index: int) -> list[Gradient]:
    """The gradients one backward call (lowered as ``blabel``) computes, numbered from ``first_index``."""
    out: list[Gradient] = []
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    for pos, a in gradient_outputs(bw):
        v = a.meta["val"]
        base = _through_views(a)
        producer = launcher = None
        if base.op == "call_function":
            launcher = f"{blabel}:{base.name}"
            producer = f"{launcher}:k" if f"{launcher}:k" in task_graph else launcher
            if launcher not in task_graph:
                producer = launcher = None
        consumers = ()
        if pos < len(placeholders):
            consumers = _consumers(placeholders[pos], flabel, task_graph)
        out.append(Gradient(first_index + len(out), tensor_bytes(v), producer, launcher, pos, consumers, blabel))
    return out


def _consumers(placeholder: fx.Node, label: str, tg: TaskGraph) -> tuple[str, ...]:
    """Tasks of compute nodes reading ``placeholder`` (through views), kernels where there are."""
    found, todo, seen = [], list(placeholder.users), set()
    while todo:
        n = todo.pop()
        if n in seen or n.op != "call_function":
            continue
        seen.add(n)
        if is_view(n):
            todo.extend(n.users)
            continue
        name = f"{label}:{n.name}"
        if f"{name}:k" in tg:
            found.append(f"{name}:k")
        elif name in tg:
            found.append(name)
    return tuple(found)


def need_gradients(s: _Start, tg: TaskGraph) -> tuple[Gradient, ...]:
    if s.captured is None:
        raise ValueError("data-parallel what-ifs need captured=<the Captured the prediction was "
                         "lowered from> to find the gradients and the tasks producing them")
    grads = gradients(s.captured, tg, s.graphs)
    grads += outside_gradients(s.current.outside_gradients, tg, len(grads))
    if not grads:
        raise ValueError("no gradients found: predict a training step (training=True) of the "
                         "same captured graphs")
    return grads


def outside_gradients(named: Sequence[tuple[str, int]], tg: TaskGraph, first_index: int) -> tuple[Gradient, ...]:
    """The gradients of parameters only eager code uses (``Prediction.outside_gradients``: each
    parameter's qualified name and bytes), numbered after the captured ones as the optimizer
    step takes them. Each is ready when the last backward task of its module (its layer, or one
    inside it) ends, where the backward names it; else when the backward's last task ends, an
    all-reduce that starts no earlier than the real one."""
    backward = [tg.task(name) for name in tg.select(phase="bw")]
    return tuple(Gradient(first_index + i, nbytes, *_made_by(backward, name.rpartition(".")[0]), position=-1)
                 for i, (name, nbytes) in enumerate(named))


def _made_by(backward: list, module: str) -> tuple[str | None, str | None]:
    """(producer, launcher) of a gradient of ``module``'s parameter: the last backward kernel (a
    GPU's; on a CPU its last task) and last host task, which launched it, of the module where it
    has backward tasks, else of the whole backward. The model's own parameters ("") have no
    module of their own."""
    inside = [t for t in backward if module and (t.layer == module or t.layer.startswith(module + "."))]
    tasks = inside or backward
    host = [t.name for t in tasks if t.kind is not TaskKind.GPU]
    kernels = [t.name for t in tasks if t.kind is TaskKind.GPU]
    launcher = host[-1] if host else None
    return (kernels[-1] if kernels else launcher), launcher
