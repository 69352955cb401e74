"""aux_stream_backward: data and weight gradients of each convolution on two CUDA streams.

The seed (apache/mxnet #14006, MXNET_GPU_WORKER_NSTREAMS=2): a convolution's backward is
two independent GEMMs, the data gradient (dgrad, needed by the next layer down) and the
weight gradient (wgrad, needed only by the optimizer). Run them on two streams and at small
batch, where neither fills the GPU, one hides the other: +2-3 % on ResNet-50 at batch 32,
~1 % at 128, nothing at 256, for +1.4 % to +2.6 % memory. The reviewers asked for the
framework to decide and keep a knob for testing: here the simulator decides
(``passes="auto"``), and naming the pass (``passes=["aux_stream_backward"]``) forces it.

The rewrite, on backward graphs, per ``aten.convolution_backward`` that computes both the
data and the weight gradient (output_mask [True, True, bias]):

    fork  = record_event(dev, 0)                 # stream 0: after the inputs are made
    wait_event(fork, dev, 1)                     # stream 1 waits for them
    wg    = convolution_backward[on stream 1](..., [False, True, bias])   # wgrad (+ bias)
    join  = record_event(dev, 1)                 # stream 1: after the wgrad
    dg    = convolution_backward(..., [True, False, False])               # dgrad, stream 0
    ...                                          # the rest of the backward, on stream 0
    wait_event(join, dev, 0, grad, input, weight)  # before the first use of wg on stream 0
                                                 # (``join="next"``: or right after the
                                                 # next convolution's dgrad, if earlier);
                                                 # holds wgrad's inputs until then

Exact: both calls are the same op with complementary masks (cuDNN / oneDNN compute the
three gradients with separate kernels anyway; bitwise equal on the zoo on CPU). The
weight-gradient node's target is ``fxdream.streams.OnStream``: the same ATen op launched on
the auxiliary stream; every node's stream is in ``meta["stream"]``, so the simulator lowers
wgrad kernels to stream 1 and the waits' events to cross-stream EVENT dependencies.
``fxdream.streams.check_stream_order`` proves the rewritten graph never uses a weight
gradient on stream 0 before its wait, nor a stream-0 value on stream 1 before its fork (the
pass raises, and so is skipped by the pipeline, if it ever did).

Memory and the caching allocator: the main stream's wait takes the wgrad's inputs as
arguments, so they stay referenced until the main stream has waited for the wgrad: every
later reuse of their blocks is ordered after it, without ``record_stream`` (which leaks
inside a multi-stream CUDA-graph capture, pytorch #155398); the wgrad's outputs get
``record_stream(main)`` outside captures. The simulator's liveness sees the same thing:
the wait is those buffers' last use, so the overlap's extra memory (inputs held while the
main stream allocates the next layers' gradients) is in the predicted peak. Not modelled:
cuDNN's own workspaces (only split-K's partial sums are held, ``OccupancyAware.workspace_bytes``,
each on its kernel's stream while it runs) and the caching allocator's per-stream pools.

``join``: "next" (default) puts convolution k's wait right after convolution k+1's dgrad:
wgrad k overlaps its own dgrad, the batch-norm / ReLU backward after it and the next dgrad,
and at most about two convolutions' inputs are held for the aux stream at a time; "end"
waits only before each gradient's first use (the graph's output): a little more overlap,
but every split convolution's inputs are held to the end of the backward (ResNet-50 at
batch 32: +1.1 GiB predicted against +48 MiB).

When it applies (the decision; ``force``):
* on CUDA, the candidate and the original graph are simulated in their step, after the
  forward (``ctx.forward``: the forward's queued kernels hide host work the split adds, which a
  backward simulated alone would pay from an empty queue), with the context's cost
  model (``fxdream.sim.occupancy.occupancy_aware``: GEMM kernels get the fill-model
  utilization) and the contention model (the context's ``predict_us`` uses the pipeline's cost model as
  it is: without the fill model it would call every wgrad small at any batch); not forced,
  the pass applies only if the predicted gain is beyond noise: > ``min_gain_pct`` % of what
  was simulated (the step; the graph alone where no forward is known) and > ``min_gain_us``;
* a ``memory_budget`` (bytes) declines it, forced or not, when the candidate's predicted
  peak (of its step, forward and backward) exceeds it;
* on the CPU there are no streams: forced, the graph is rewritten (stream metadata kept, the
  two calls run one after the other, numerically identical) and the reason says "CPU: no
  concurrent streams" with the gain predicted for ``ctx.sim_device`` (or h100) with the
  analytic model; not forced, it is not applied, with the same prediction in the reason.
``force``: None (default) follows ``ctx.forced`` (True when the user named the pass, False
under ``passes="auto"``); True/False override it, e.g. ``passes=[AuxStreamBackward(force=False)]``
decides by the prediction although named.

How the gain depends on the contention model's utilization (``Contention``: kernels on
different streams share the device by processor sharing, each running at
``min(1, capacity / sum(utilization))``): a dgrad of length D and fill u_d overlapped with
a wgrad of length W and fill u_w saves ``min(D, W) * (2 - max(1, (u_d + u_w) / capacity))``,
with the default capacity 1: ``min(D, W) * min(1, 2 - u_d - u_w)``: everything of the
shorter one while u_d + u_w <= 1, nothing when both fill the device (u = 1). Each
convolution also pays two event markers on stream 0 (~ the device's smallest kernel each)
and four host calls. Utilization comes from the fill model (fxdream/sim/occupancy.py:
thread blocks of the tiled GEMM over SM slots, split-K for wgrad), which makes u grow with
batch size; the output-elements estimate of ``Analytic.utilization`` would call every wgrad
tiny at any batch and predict large gains at batch 256, where the seed measured none.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.fx as fx

from fxdream.ir.nodes import is_view
from fxdream.pass_api import LAYER, PHASE, PassBase, PassContext, PassResult, copy_graph_module, register_pass, value_of
from fxdream.runtime import streams
from fxdream.sim.cost.analytic import Analytic
from fxdream.sim.cost.devices import get_device
from fxdream.sim.cost.occupancy import occupancy, occupancy_aware
from fxdream.sim.prediction import step_prediction

aten = torch.ops.aten
CONV_BW = aten.convolution_backward.default
STREAM = streams.STREAM
AUX = 1
DEFAULT_GPU = "h100"
NO_STREAMS = "CPU: no concurrent streams"
JOINS = ("next", "end")
ON_AUX = {AUX: streams.OnStream(CONV_BW, AUX)}


@dataclass
class Site:
    """One split convolution: its two calls and the event nodes around the weight gradient."""
    layer: str
    dgrad: fx.Node
    wgrad: fx.Node
    fork: fx.Node
    join: fx.Node
    wait: fx.Node | None = None



def find_sites(graph: fx.Graph) -> tuple[list[fx.Node], list[str]]:
    """convolution_backward nodes computing dgrad and wgrad; notes on the ones left alone."""
    sites, notes = [], []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not CONV_BW:
            continue
        layer = node.meta.get(LAYER) or node.name
        if node.kwargs or len(node.args) != 11:
            notes.append(f"{layer}: left alone: unexpected convolution_backward signature")
            continue
        mask = list(node.args[10])
        if not mask[1]:
            notes.append(f"{layer}: left alone: no weight gradient to move")
        elif not mask[0]:
            notes.append(f"{layer}: left alone: weight gradient only (no data gradient to overlap with)")
        elif any(u.op != "call_function" or u.target is not operator.getitem for u in node.users):
            notes.append(f"{layer}: left alone: its result is used other than through getitem")
        else:
            sites.append(node)
    return sites, notes


def _copy_meta(new: fx.Node, old: fx.Node, val, stream: int) -> None:
    new.meta.update({k: v for k, v in old.meta.items() if k not in ("val", STREAM)})
    if val is not None:
        new.meta["val"] = val
    if stream:
        new.meta[STREAM] = stream


def _event_meta(node: fx.Node, like: fx.Node, stream: int) -> None:
    node.meta[LAYER] = like.meta.get(LAYER, "")
    node.meta[PHASE] = like.meta.get(PHASE, "bw")
    node.meta[STREAM] = stream
    node.meta["val"] = None  # an event returns nothing


def split(gm: fx.GraphModule, join: str = "next", stream: int = AUX) -> tuple[fx.GraphModule, list[Site], list[str]]:
    """Rewrite ``gm`` in place (give it a copy): dgrad on stream 0, wgrad on ``stream``, events."""
    if join not in JOINS:
        raise ValueError(f"join={join!r}; valid: {', '.join(JOINS)}")
    ON_AUX.setdefault(stream, streams.OnStream(CONV_BW, stream))
    graph = gm.graph
    nodes, notes = find_sites(graph)
    sites: list[Site] = []
    for cb in nodes:
        args, mask = tuple(cb.args[:10]), list(cb.args[10])
        device = str(value_of(cb.args[0]).device) if isinstance(value_of(cb.args[0]), torch.Tensor) else "cpu"
        val = value_of(cb)
        kind = type(val) if isinstance(val, (tuple, list)) else tuple
        vals = list(val) if isinstance(val, (tuple, list)) else [None, None, None]
        with graph.inserting_before(cb):
            fork = graph.call_function(streams.record_event, (device, 0))
            aux_wait = graph.call_function(streams.wait_event, (fork, device, stream))
            wg = graph.call_function(ON_AUX[stream], args + ([False, True, bool(mask[2])],))
            join_node = graph.call_function(streams.record_event, (device, stream))
            dg = graph.call_function(CONV_BW, args + ([True, False, False],))
        _event_meta(fork, cb, 0)
        _event_meta(aux_wait, cb, stream)
        _event_meta(join_node, cb, stream)
        _copy_meta(wg, cb, kind([None, vals[1], vals[2] if mask[2] else None]) if val is not None else None, stream)
        _copy_meta(dg, cb, kind([vals[0], None, None]) if val is not None else None, 0)
        for user in list(cb.users):
            index = user.args[1]
            user.args = (dg if index == 0 else wg, index)
            if index != 0:
                user.meta[STREAM] = stream
        graph.erase_node(cb)
        sites.append(Site(cb.meta.get(LAYER) or cb.name, dg, wg, fork, join_node))
    _place_waits(graph, sites, join, stream)
    graph.lint()
    gm.recompile()
    return gm, sites, notes


def _first_use_off_stream(graph: fx.Graph, value: fx.Node, stream: int, order: dict) -> fx.Node:
    """The first node (program order) that reads ``value``, through views, not on ``stream``."""
    first, todo, seen = None, [value], set()
    while todo:
        v = todo.pop()
        for user in v.users:
            if user in seen:
                continue
            seen.add(user)
            if user.op == "call_function" and is_view(user) and streams.node_stream(user) == stream:
                todo.append(user)
                continue
            if user.op == "output" or streams.node_stream(user) != stream:
                if first is None or order[user] < order[first]:
                    first = user
            else:
                todo.append(user)  # more work on the aux stream: its users count too
    return first if first is not None else next(n for n in graph.nodes if n.op == "output")


def _place_waits(graph: fx.Graph, sites: list[Site], join: str, stream: int) -> None:
    order = {n: i for i, n in enumerate(graph.nodes)}
    positions = []
    for k, site in enumerate(sites):
        before = _first_use_off_stream(graph, site.wgrad, stream, order)
        if join == "next" and k + 1 < len(sites):
            after_next_dgrad = sites[k + 1].dgrad.next
            if order[after_next_dgrad] < order[before]:
                before = after_next_dgrad
        positions.append(before)
    for site, before in zip(sites, positions):
        device = site.fork.args[0]
        keep = tuple(a for a in site.wgrad.args[:3] if isinstance(a, fx.Node))
        with graph.inserting_before(before):
            site.wait = graph.call_function(streams.wait_event, (site.join, device, 0) + keep)
        _event_meta(site.wait, site.wgrad, 0)


_BACKWARD_ONLY = "rewrites backward graphs (convolution_backward); forward graphs are left as they are"


@register_pass
class AuxStreamBackward(PassBase):
    """See the module docstring."""
    name = "aux_stream_backward"
    modes, phases = ("training",), ("bw",)
    why_not = MappingProxyType({"mode": _BACKWARD_ONLY, "phase": _BACKWARD_ONLY,
                                "device": "no streams on device {device!r}"})
    order = 10  # schedules the final graph's kernels: after the passes that rewrite it

    def __init__(self, force: bool | None = None, join: str = "next", min_gain_pct: float = 1.0,
                 min_gain_us: float = 5.0, gpu: str | None = None):
        if join not in JOINS:
            raise ValueError(f"join={join!r}; valid: {', '.join(JOINS)}")
        self.force, self.join = force, join
        self.min_gain_pct, self.min_gain_us = float(min_gain_pct), float(min_gain_us)
        self.gpu = gpu

    # --- prediction ---------------------------------------------------------------------------
    def _cost(self, ctx: PassContext):
        """(cost model, device name, analytic?) used to judge: the context's if it is for a GPU."""
        cost = ctx.cost_model
        if ctx.device == "cuda" and cost is not None and cost.device.kind == "cuda":
            return occupancy_aware(cost), cost.device.name
        name = self.gpu or (ctx.sim_device if ctx.sim_device and ctx.sim_device != "cpu" else DEFAULT_GPU)
        spec = get_device(name)
        if spec.kind != "cuda":
            spec = get_device(DEFAULT_GPU)
        return occupancy_aware(Analytic(spec)), spec.name

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        nodes, notes = find_sites(gm.graph)
        if not nodes:
            return PassResult(gm, False, "no convolution_backward computing both data and weight gradients",
                              tuple(notes))
        candidate, sites, _ = split(copy_graph_module(gm), self.join)
        streams.require_stream_order(candidate)
        forced = ctx.forced if self.force is None else self.force
        on_cpu = ctx.device == "cpu"
        n = len(sites)
        what = f"split {n} convolution_backward into dgrad (stream 0) + wgrad (stream {AUX})"
        cost, device_name = self._cost(ctx) if (ctx.cost_model is not None or on_cpu) else (None, None)
        if cost is None:
            if not forced:
                return PassResult(gm, False, "no cost model to predict the gain", tuple(notes))
            return PassResult(candidate, True, f"{what}; no cost model: applied as asked", tuple(notes))
        (before_us, before_peak), (after_us, after_peak) = (step_prediction(ctx.forward, gm, cost),
                                                            step_prediction(ctx.forward, candidate, cost))
        gain_us = before_us - after_us
        pct = 100.0 * gain_us / before_us if before_us else 0.0
        grow = after_peak - before_peak
        step = " (the step: forward and backward)" if ctx.forward is not None else ""
        predicted = (f"predicted on {device_name}{step}: {before_us / 1e3:.3f} → {after_us / 1e3:.3f} ms "
                     f"({-pct:+.1f} %), peak {grow / 2**20:+.2f} MiB")
        notes = [predicted] + self._site_notes(candidate, sites, cost) + notes
        if ctx.memory_budget is not None and after_peak > ctx.memory_budget:
            return PassResult(gm, False, f"predicted peak {after_peak / 2**20:.1f} MiB exceeds "
                              f"memory_budget {ctx.memory_budget / 2**20:.1f} MiB (the overlap keeps "
                              f"{grow / 2**20:+.2f} MiB more alive; {predicted})", tuple(notes))
        if on_cpu:
            if not forced:
                return PassResult(gm, False, f"{NO_STREAMS}: not applied ({predicted})", tuple(notes))
            return PassResult(candidate, True, f"{NO_STREAMS}: {what}, run one after the other here "
                              f"(numerically identical); stream metadata kept ({predicted})", tuple(notes))
        noise = max(self.min_gain_pct / 100.0 * before_us, self.min_gain_us)
        if gain_us > noise:
            return PassResult(candidate, True, f"{what}; {predicted}", tuple(notes))
        if forced:
            verdict = (f"predicted slower, {-gain_us:.1f} µs more" if gain_us < 0 else
                       f"predicted gain {gain_us:.1f} µs is not beyond noise, {noise:.1f} µs")
            return PassResult(candidate, True, f"{what} (forced: {verdict}); {predicted}", tuple(notes))
        if gain_us < 0:  # a loss is no noise to call
            return PassResult(gm, False, f"predicted slower: {-gain_us:.1f} µs ({-pct:.1f} %) more; force it with "
                              f"passes=['{self.name}'] ({predicted})", tuple(notes))
        return PassResult(gm, False, f"predicted gain {gain_us:.1f} µs ({pct:.1f} %) is not beyond noise "
                          f"(> {self.min_gain_pct:g} % and > {self.min_gain_us:g} µs); force it with "
                          f"passes=['{self.name}'] ({predicted})", tuple(notes))

    @staticmethod
    def _site_notes(gm: fx.GraphModule, sites: list[Site], cost) -> list[str]:
        sms = cost.device.num_sms or 0
        out = []
        for s in sites:
            d, w = cost.kernel_us(s.dgrad), cost.kernel_us(s.wgrad)
            ud, uw = occupancy(s.dgrad, sms) or 1.0, occupancy(s.wgrad, sms) or 1.0
            out.append(f"{s.layer}: dgrad {d:.1f} µs (fill {ud:.2f}) ∥ wgrad {w:.1f} µs (fill {uw:.2f}): "
                       f"overlap saves up to {min(d, w) * min(1.0, 2.0 - ud - uw):.1f} µs")
        return out
