"""In-context timing: each op of a graph timed where it really runs, inside a run of the graph.

An op timed alone in a loop runs with hot caches and a warm allocator; inside the model it
does not. So a copy of the graph's generated code reads the clock around each compute op
(``timed_copy``), and ``time_graph`` runs it on the graph's real inputs."""
from __future__ import annotations

import copy
import math
import time
import weakref

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_flatten, tree_map

from fxdream.ir.aliasing import written_inputs
from fxdream.ir.nodes import arg_values, is_view, op_name
from fxdream.ir.tensors import real_tensors, size_hint
from fxdream.runtime.cuda_graph_runner import capture_paused
from fxdream.sim.profile import cuda_timing
from fxdream.sim.profile.cuda_timing import HOLD_EXTRA_US, HOLD_MARGIN
from fxdream.sim.profile.op_keys import HOST_SYNC_OPS, profile_key

HOST = "host|"  # prefix of the keys of host (dispatch + launch) times, on a GPU

MIN_ROUNDS = 3  # past these timed rounds, no new round starts once the budget is spent
# ... except for a long graph: two rounds that took this long in all are enough (the faster is
# kept). Such a graph's ops are milliseconds long, so a cold first round (oneDNN primitives
# built) is a small share of a run, and every further round costs seconds of build time.
LONG_ROUNDS_S = 2.0
# ... and for any graph whose two rounds took AGREED_ROUNDS_S in all and agree within AGREED:
# a third could move their median by no more than they differ, and would cost a whole run of
# build time.
AGREED, AGREED_ROUNDS_S = 0.02, 0.05

_STAMPS: list[tuple[int, float]] = []  # (op index, seconds) from the timed graph running now


def _start() -> float:
    return time.perf_counter()


def _stop(index: int, started: float, _result) -> None:
    _STAMPS.append((index, time.perf_counter() - started))


# On a GPU: an event between consecutive timed ops (one event serves as one op's end and the
# next one's start, so a graph queues about one event per kernel) and the host's clock.
_LAST_EVENT: list = []


def _start_cuda() -> tuple:
    if not _LAST_EVENT:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        _LAST_EVENT.append(event)
    return _LAST_EVENT[-1], time.perf_counter()


def _stop_cuda(index: int, started: tuple, _result) -> None:
    host = time.perf_counter() - started[1]
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    _LAST_EVENT[:] = [event]
    _STAMPS.append((index, host, started[0], event))


def _waits_for_the_device(gm: fx.GraphModule) -> bool:
    """A node that makes the host wait for the GPU: a value read back, or a copy to the CPU."""
    def on(value, kind):
        return isinstance(value, torch.Tensor) and value.device.type == kind
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if op_name(node) in HOST_SYNC_OPS:
            return True
        if on(node.meta.get("val"), "cpu") and any(on(a.meta.get("val"), "cuda") for a in node.all_input_nodes):
            return True
    return False


def _untimed_work_ran() -> None:
    _LAST_EVENT.clear()  # the next timed op records its own start event


def _cuda_round(timed, inputs, hold_us: float) -> tuple:
    """One run of a timed graph on a GPU held busy for ``hold_us`` first (see cuda_timing):
    (outputs, host seconds of the run, [(op index, device s, host s)])."""
    gap_s = cuda_timing.event_gap_us() * 1e-6
    _LAST_EVENT.clear()
    cuda_timing.hold_gpu(hold_us)
    began = time.perf_counter()
    outputs = timed.forward(*inputs)  # not __call__: torch.fx prints a failing graph's traceback there
    host_s = time.perf_counter() - began
    torch.cuda.synchronize()
    stamps = [(index, max(start.elapsed_time(end) * 1e-3 - gap_s, 0.0), host) for index, host, start, end in _STAMPS]
    _LAST_EVENT.clear()
    return outputs, host_s, stamps


_TIMED: "weakref.WeakKeyDictionary[fx.GraphModule, tuple]" = weakref.WeakKeyDictionary()


def timed_copy(gm: fx.GraphModule, device_type: str) -> tuple[fx.GraphModule, list[str]]:
    """A copy of ``gm`` whose generated code reads the clock around each compute op, and the
    profile keys of the ops it times (by index). Cached per graph while its nodes are unchanged
    (the cache holds no reference to ``gm``: keys, not nodes).

    Generated code, not an fx.Interpreter: timed through an Interpreter, small ops come out far
    slower than inside the graph (the Interpreter's Python between ops, fetching arguments and its
    environment, where generated code has none); read in generated code, they sum to about one run
    of the graph."""
    cached = _TIMED.get(gm)
    version = (graph_fingerprint(gm), device_type)
    if cached is not None and cached[0] == version:
        return cached[1], cached[2]
    graph = copy.deepcopy(gm.graph)
    start, stop = (_start_cuda, _stop_cuda) if device_type == "cuda" else (_start, _stop)
    keys = compute_keys(gm, device_type)  # usually known already (to_time_in_context asked)
    index = 0
    for node in list(graph.nodes):
        if node.op == "call_function" and not is_view(node):
            with graph.inserting_before(node):
                started = graph.call_function(start, ())
            with graph.inserting_after(node):
                graph.call_function(stop, (index, started, node))
            index += 1
        elif node.op == "call_module" and device_type == "cuda":  # untimed work (a CUDA-graph region):
            with graph.inserting_after(node):                      # the next op starts a new event
                graph.call_function(_untimed_work_ran, ())
    timed = fx.GraphModule(gm, graph)
    _TIMED[gm] = (version, timed, keys)
    return timed, keys


def time_graph(gm: fx.GraphModule, inputs, device: torch.device, samples: dict, rounds: int,
               warmup: int, budget_s: float = math.inf, give_up_above_us: float = math.inf,
               raise_errors: bool = False, every_round: bool = False,
               one_round_above_s: float = math.inf, one_round_under_us: float = math.inf) -> dict | None:
    """Add each profile key's in-context time per round to ``samples``; return the output values
    by node name. No third round where both timed ones took more than ``give_up_above_us`` in
    all: a candidate clearly slower than another needs no median, but one run can be cold (a
    new oneDNN primitive per conv, far longer than a small graph's run) or caught in a noise
    spike, so giving up on the second run alone can pick the wrong candidate. Nor where
    the two agree (``AGREED``). Of two timed rounds (these, or a long graph's) only the faster
    is kept: the median of two is their mean, which one cold run would skew.

    A key's sample for one round is the mean over its instances in the graph, so that the key's
    cost times its count is what those instances took. Instances of one op and shape need not
    cost the same in context (one can run slower than the others, run after run): the median of
    their pooled times would be the fast ones', and the graph predicted faster than it runs.
    A graph that raises gives None, or with ``raise_errors`` the error. ``every_round``: all
    ``rounds`` run and every one is a sample (no stop on agreement, no faster-of-two): the spread
    the prediction's range is read from (``SpreadBound``). ``one_round_above_s``: a first timed
    round longer than this is the only one (a first look, which side-by-side rounds time again:
    ``Profiled.profile_side_by_side``), where it took under ``one_round_under_us`` (the best
    prediction so far of the graph a candidate would replace): a candidate whose one round reads
    slower gets more rounds, as any graph does (the faster of two, or a median), so that one noisy
    round does not decide against it (a slow first look keeps it out of the side-by-side rounds)."""
    outputs, taken = None, []
    cuda = device.type == "cuda"
    if cuda:  # the first run on a GPU autotunes (cuDNN) and tells how long the host takes to queue it
        warmup, hold_us = max(warmup, 1), 0.0
        holds = not _waits_for_the_device(gm)  # a sync would wait out the hold
    try:
        timed, keys = timed_copy(gm, device.type)
        with torch.no_grad(), capture_paused():
            for i in range(warmup + rounds):
                if i == warmup:
                    timed_from = time.perf_counter()
                elif i - warmup >= MIN_ROUNDS and time.perf_counter() - timed_from > budget_s:
                    break
                elif i - warmup >= 2 and time.perf_counter() - timed_from > LONG_ROUNDS_S:
                    break
                _STAMPS.clear()
                if cuda:  # device time under the op's key, host time under "host|" + key
                    outputs, host_s, stamps = _cuda_round(timed, inputs, hold_us)
                    hold_us = host_s * 1e6 * HOLD_MARGIN + HOLD_EXTRA_US if holds else 0.0
                else:
                    outputs = timed.forward(*inputs)  # not __call__ (see _cuda_round)
                    stamps = [(index, seconds, seconds) for index, seconds in _STAMPS]
                if i >= warmup:
                    this_round: dict[str, list[float]] = {}
                    for index, seconds, host in stamps:
                        this_round.setdefault(keys[index], []).append(seconds * 1e6)
                        if cuda:
                            this_round.setdefault(HOST + keys[index], []).append(host * 1e6)
                    taken.append((sum(seconds for _, seconds, _ in stamps) * 1e6,
                                  {key: sum(times) / len(times) for key, times in this_round.items()}))
                    if i == warmup and not every_round and time.perf_counter() - timed_from > one_round_above_s \
                            and taken[0][0] < one_round_under_us:
                        break
                    if i == warmup + 1 and not every_round and (
                            min(total for total, _ in taken) > give_up_above_us
                            or _agreed(taken, time.perf_counter() - timed_from)):
                        break
    except Exception:  # a graph that cannot run outside its wrappers: keep micro-benchmarks
        if raise_errors:
            raise
        return None
    finally:
        _STAMPS.clear()
    for _, this_round in [min(taken, key=lambda t: t[0])] if len(taken) == 2 and not every_round else taken:
        for key, us in this_round.items():
            samples.setdefault(key, []).append(us)
    output = next(n for n in gm.graph.nodes if n.op == "output")
    names = [a.name if isinstance(a, fx.Node) else None for a in tree_flatten(output.args)[0]]
    return {name: value for name, value in zip(names, tree_flatten(outputs)[0]) if name}


def _agreed(taken: list, seconds: float) -> bool:
    (first, _), (second, _) = taken
    return seconds >= AGREED_ROUNDS_S and abs(first - second) <= AGREED * min(first, second)


def owned_copies(inputs, gm: fx.GraphModule | None = None) -> list:
    """Copies of the tensors ``gm`` may update in place (BatchNorm's running statistics in
    training; without ``gm``, every one but the parameters), so that timed runs leave the
    model's alone. Only those: cloning every buffer of a model costs time on every timed graph."""
    written = written_inputs(gm) if gm is not None else None
    with real_tensors():
        return [x.clone() if isinstance(x, torch.Tensor) and not isinstance(x, torch.nn.Parameter)
                and (written is None or i in written) else x for i, x in enumerate(inputs)]


def ones_like(value, device: torch.device):
    """A real tensor of ones with ``value``'s shape, dtype and strides (a backward graph traced
    with channels_last tangents runs only on those), other values as they are."""
    if isinstance(value, torch.Tensor):
        shape, stride = tuple(map(size_hint, value.shape)), tuple(map(size_hint, value.stride()))
        return torch.empty_strided(shape, stride, dtype=value.dtype, device=device).fill_(1)
    return value


def random_like(value, device: torch.device):
    """A real tensor like a fake one: random floats, zeros for integers (always valid indices)."""
    if not isinstance(value, torch.Tensor):
        return size_hint(value)
    if not isinstance(value, FakeTensor):
        return value  # a real constant (a folded or prepacked weight): time it as it is
    shape, stride = tuple(map(size_hint, value.shape)), tuple(map(size_hint, value.stride()))
    storage = sum((s - 1) * st for s, st in zip(shape, stride) if s > 0) + 1
    if value.is_floating_point():
        flat = torch.randn(storage, dtype=value.dtype, device=device)
    else:
        flat = torch.zeros(storage, dtype=value.dtype, device=device)
    if not value.numel():
        return torch.empty(shape, dtype=value.dtype, device=device)
    return torch.as_strided(flat, shape, stride)


def synthetic_args(node: fx.Node, device: torch.device) -> tuple[tuple, dict]:
    """(args, kwargs) to call ``node``'s op with alone: ``random_like`` of each value, except the
    generator state ``run_with_rng_state`` (activation checkpointing's replayed dropout) sets
    before its op, which must be a valid one: the generator's current state (the op puts the
    state it found back)."""
    args, kwargs = tree_map(lambda v: random_like(v, device), arg_values(node))
    if node.target is torch.ops.higher_order.run_with_rng_state and args:
        args = (torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state(), *args[1:])
    return args, kwargs


def compute_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes that are timed (compute ops, views excluded), in graph order."""
    return [n for n in gm.graph.nodes if n.op == "call_function" and not is_view(n)]


_KEYS: "weakref.WeakKeyDictionary[fx.GraphModule, tuple]" = weakref.WeakKeyDictionary()


def graph_fingerprint(gm: fx.GraphModule) -> tuple:
    """What the caches here key a graph on: its nodes' names, targets and arguments (cheap next
    to code generation). Not ``gm.code``: a pass's candidate copy generates its code only when
    run (``copy_graph_module``), and asking for it would generate the code of every candidate
    that only needs its profile keys. Holds no nodes nor targets (a cache must not keep a graph alive)."""
    return tuple((n.name, n.op, id(n.target), repr(n.args), repr(n.kwargs)) for n in gm.graph.nodes)


def compute_keys(gm: fx.GraphModule, device_type: str) -> list[str]:
    """The profile keys of ``gm``'s compute ops (views excluded), cached while its nodes are
    unchanged (``graph_fingerprint``): a build asks several times per graph whether all were
    timed in context."""
    cached = _KEYS.get(gm)
    version = (graph_fingerprint(gm), device_type)
    if cached is not None and cached[0] == version:
        return cached[1]
    keys = [profile_key(n, device_type) for n in compute_nodes(gm)]
    _KEYS[gm] = (version, keys)
    return keys
