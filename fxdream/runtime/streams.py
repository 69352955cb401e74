"""Run an FX graph's nodes on several CUDA streams, ordered by explicit events in the graph.

A graph says where each kernel runs with ``node.meta["stream"]`` (0: the stream the graph
is called on, ``k >= 1``: auxiliary stream ``k`` of the device), and carries the ordering
between streams itself, as CUDA programs do, with two kinds of nodes:

* ``record_event(device, stream)`` → a ``torch.cuda.Event`` recorded on ``stream`` after
  everything launched on it so far (in program order: the graph's node order);
* ``wait_event(event, device, stream, *keep_alive)``: ``stream`` waits for that event
  before anything launched on it later. The tensors in ``keep_alive`` are only held (they
  are arguments, so the generated code frees them after this call): see below.

A node runs on an auxiliary stream by having an ``OnStream(op, k)`` target: it calls ``op``
(an ATen overload) with stream ``k`` current and otherwise looks like ``op`` to fxdream
(same ``overloadpacket``, ``_schema`` and ``tags``: cost models, the FLOP counter and
``op_name`` see ``aten.convolution_backward``). Every helper is self-contained: no node
leaves the current stream switched, so a node timed alone (the Profiled cost model), a
graph that raises half-way, or a pass that moves other nodes cannot leave work on the wrong
stream. Each node's stream is also in its meta: that is what the simulator lowers (a
wait's event and cross-stream data dependencies become EVENT edges there).

Caching-allocator safety: a block must not be handed out again by its own stream while
another stream may still use it.

* Inputs of an aux-stream op (allocated on the main stream): the graph passes them to the
  main stream's ``wait_event`` for that op's join, so they stay referenced until the main
  stream has waited for the aux stream; every later main-stream kernel, and so every
  reuse of their blocks, is ordered after the aux kernel. No ``record_stream``: inside a
  CUDA-graph capture ``record_stream`` on several streams leaks memory until OOM
  (pytorch/pytorch #155398); this is the fork/join-with-events pattern ``torch.cuda.graph``
  expects for multi-stream capture (fork: aux waits on an event of the capture stream;
  join: the capture stream waits on aux before the capture ends). The simulator sees the
  same thing: the wait is the buffers' last use, so they are freed when it runs.
* Outputs of an aux-stream op (allocated on the aux stream, used on the main stream after
  the wait): eagerly ``record_stream(main)``, so the aux stream cannot reuse the block
  before the main stream is done with it; inside a capture nothing (they leave the
  captured graph as its outputs). ``OnStream(..., record_inputs=True)`` also calls
  ``record_stream(aux)`` on the inputs, for use without a keep-alive wait.

On the CPU (or with fake/meta tensors) there are no streams: every helper is a no-op and
``OnStream`` calls its op, so the graph runs its nodes in order with identical numerics.

``check_stream_order(gm)`` proves a graph's cross-stream uses are ordered (vector clocks
over program order) and returns the violations.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxdream.ir.nodes import is_view, schema_arguments

STREAM = "stream"  # node.meta key (the same as fxdream.sim.lower.STREAM)

_aux_streams: dict[tuple[int, int], "torch.cuda.Stream"] = {}


def _is_fake(value) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor  # private class, isolated here
    return isinstance(value, FakeTensor)


@functools.lru_cache(maxsize=None)
def _device(name: str) -> torch.device:
    return torch.device(name)


@functools.lru_cache(maxsize=1)
def _have_cuda() -> bool:
    return torch.cuda.is_available()


def _cuda(device: str | torch.device) -> torch.device | None:
    """The CUDA device to act on, or None where there are no streams (CPU, no CUDA, meta)."""
    d = device if isinstance(device, torch.device) else _device(device)
    if d.type != "cuda" or not _have_cuda():
        return None
    return d if d.index is not None else torch.device("cuda", torch.cuda.current_device())


def get_stream(device: str | torch.device, index: int) -> "torch.cuda.Stream":
    """Stream ``index`` of ``device``: 0 is the current stream, k >= 1 a cached auxiliary one."""
    d = _cuda(device)
    if d is None:
        raise ValueError(f"no CUDA streams on {device!r}")
    if index == 0:
        return torch.cuda.current_stream(d)
    key = (d.index, int(index))
    stream = _aux_streams.get(key)
    if stream is None:
        stream = _aux_streams[key] = torch.cuda.Stream(d)
    return stream


def record_event(device: str, stream: int):
    """Record an event on ``stream`` (after all work launched on it so far); None without CUDA."""
    d = _cuda(device)
    if d is None:
        return None
    return get_stream(d, stream).record_event()


def wait_event(event, device: str, stream: int, *keep_alive) -> None:
    """Make ``stream`` wait for ``event``; ``keep_alive`` tensors were held until now."""
    if event is None:
        return None
    d = _cuda(device)
    if d is not None:
        get_stream(d, stream).wait_event(event)
    return None


# a node that only orders streams has no users and must survive dead-code elimination
for _fn in (record_event, wait_event):
    fx.node.has_side_effect(_fn)


class OnStream:
    """``op`` launched on auxiliary stream ``stream``; otherwise indistinguishable from ``op``
    for fxdream's cost models (same overload packet, schema and tags)."""

    def __init__(self, op: torch._ops.OpOverload, stream: int, record_inputs: bool = False):
        if stream < 1:
            raise ValueError(f"OnStream is for auxiliary streams (>= 1), got {stream}")
        self.op, self.stream, self.record_inputs = op, int(stream), bool(record_inputs)
        self.overloadpacket = op.overloadpacket
        self._schema = op._schema
        self.tags = tuple(getattr(op, "tags", ()))
        self.__name__ = f"{op.overloadpacket.__name__}_on_stream{self.stream}"
        self.__qualname__ = self.__name__
        self.__module__ = __name__

    def __repr__(self) -> str:
        return f"OnStream({self.op}, {self.stream})"

    def __eq__(self, other) -> bool:
        return isinstance(other, OnStream) and (self.op, self.stream, self.record_inputs) == \
            (other.op, other.stream, other.record_inputs)

    def __hash__(self) -> int:
        return hash((OnStream, self.op, self.stream, self.record_inputs))

    def __call__(self, *args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        device = next((t.device for t in tensors if t.device.type == "cuda"), None)
        if device is None or _cuda(device) is None or any(_is_fake(t) for t in tensors):
            return self.op(*args, **kwargs)
        home = torch.cuda.current_stream(device)
        aux = get_stream(device, self.stream)
        if device.index is None or device.index == torch.cuda.current_device():
            torch.cuda.set_stream(aux)  # cheaper than the context manager, same device
            try:
                out = self.op(*args, **kwargs)
            finally:
                torch.cuda.set_stream(home)
        else:
            with torch.cuda.stream(aux):
                out = self.op(*args, **kwargs)
        if not torch.cuda.is_current_stream_capturing():  # no record_stream in a capture (#155398)
            if self.record_inputs:
                for t in tensors:
                    t.record_stream(aux)
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    t.record_stream(home)
        return out


def is_event_node(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target in (record_event, wait_event)


def node_stream(node: fx.Node) -> int:
    """The stream a node runs on: an event node's own argument, else meta["stream"] (default 0)."""
    if node.op == "call_function" and node.target is record_event:
        return int(node.args[1])
    if node.op == "call_function" and node.target is wait_event:
        return int(node.args[2])
    if node.op == "call_function" and isinstance(node.target, OnStream):
        return node.target.stream
    return int(node.meta.get(STREAM, 0))


# --- the checker --------------------------------------------------------------------------------

@dataclass(frozen=True)
class Violation:
    node: str        # the node that uses (or overwrites) the value too early
    value: str       # the value
    produced_on: int
    used_on: int
    why: str

    def __str__(self) -> str:
        return f"{self.node} uses {self.value} on stream {self.used_on}: {self.why}"


def _mutated_args(node: fx.Node) -> list[fx.Node]:
    return [value for argument, value in schema_arguments(node)
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, fx.Node)]


def require_stream_order(gm: fx.GraphModule | fx.Graph) -> None:
    """Raise (so the pass pipeline reports the rewrite and drops it) where ``check_stream_order``
    finds a cross-stream use left unordered."""
    problems = check_stream_order(gm)
    if problems:
        raise RuntimeError(f"stream ordering broken: {problems[0]} (+{len(problems) - 1} more)")


def check_stream_order(gm: fx.GraphModule | fx.Graph) -> list[Violation]:
    """Every cross-stream use of a value must happen after the use's stream waited for it.

    Happens-before with vector clocks over program order (how the generated code launches
    work): a kernel on stream s ticks clock[s]; ``record_event`` snapshots its stream's
    clock; ``wait_event`` merges the snapshot into the waiting stream's clock. A value made
    at (s, t) may be read on stream u only if clock_u[s] >= t, and a value read on another
    stream may be overwritten in place only after that read is ordered too. Graph inputs
    are made on stream 0 before the graph starts; the graph's outputs are read on stream 0
    (the caller's stream). Views (getitem, aten views) carry their base's time.
    """
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    clocks: dict[int, dict[int, int]] = {0: {0: 1}}
    made: dict[fx.Node, tuple[int, int]] = {}          # value → (stream, time) of its producer
    reads: dict[fx.Node, list[tuple[int, int]]] = {}   # value (base) → (stream, time) of readers
    base_of: dict[fx.Node, fx.Node] = {}
    snapshots: dict[fx.Node, dict[int, int]] = {}     # record_event node → its stream's clock
    problems: list[Violation] = []

    def clock(s: int) -> dict[int, int]:
        return clocks.setdefault(s, {})

    def check_read(user: fx.Node, value: fx.Node, u: int) -> None:
        if value not in made:
            return
        s, t = made[value]
        if s != u and clock(u).get(s, 0) < t:
            problems.append(Violation(user.name, value.name, s, u,
                                      f"made on stream {s} but stream {u} has not waited for it"))

    for node in graph.nodes:
        if node.op in ("placeholder", "get_attr"):
            made[node] = (0, 1)
            base_of[node] = node
            continue
        if node.op == "output":
            for arg in node.all_input_nodes:
                check_read(node, arg, 0)
            continue
        u = node_stream(node)
        if node.target is record_event:
            snapshots[node] = dict(clock(u))
            continue
        if node.target is wait_event:
            snap = snapshots.get(node.args[0], {})
            mine = clock(u)
            for s, t in snap.items():
                mine[s] = max(mine.get(s, 0), t)
            continue
        for arg in node.all_input_nodes:
            check_read(node, arg, u)
        for target in _mutated_args(node):
            base = base_of.get(target, target)
            for s, t in reads.get(base, []):
                if s != u and clock(u).get(s, 0) < t:
                    problems.append(Violation(node.name, target.name, s, u,
                                              f"overwritten on stream {u} while stream {s} may still read it"))
        if is_view(node) and node.all_input_nodes:
            first = node.all_input_nodes[0]
            made[node] = made.get(first, (u, clock(u).get(u, 0)))
            base_of[node] = base_of.get(first, first)
            continue
        mine = clock(u)
        mine[u] = mine.get(u, 0) + 1
        made[node] = (u, mine[u])
        base_of[node] = node
        for arg in node.all_input_nodes:
            reads.setdefault(base_of.get(arg, arg), []).append((u, mine[u]))
    return problems


def stream_summary(gm: fx.GraphModule) -> dict[int, int]:
    """Stream → number of kernels (non-view compute nodes) that run on it."""
    counts: dict[int, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and not is_view(node) and not is_event_node(node):
            s = node_stream(node)
            counts[s] = counts.get(s, 0) + 1
    return counts


__all__ = ["STREAM", "OnStream", "Violation", "check_stream_order", "get_stream", "is_event_node",
           "node_stream", "record_event", "stream_summary", "wait_event"]
