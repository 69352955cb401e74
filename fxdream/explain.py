"""The batch size up to which aux_stream_backward is predicted to help, as a sympy formula.

From the analytic cost model (roofline per kernel, the fill model of
``fxdream.sim.occupancy`` for GEMM kernels and the contention model of
``fxdream.sim.simulate``), with the batch size ``b`` as a symbol, for one backward graph:

    gain(b) = Max(C, G(b)) - Max(C + dC, G(b) - O(b) + M)

* ``C``: host time to launch the backward (dispatch + launch of every op; batch-independent),
  ``dC``: what the rewrite adds to it (three event calls and one more convolution call per
  split convolution);
* ``G(b)``: device time of the backward's kernels on one stream (each kernel
  ``Max(floor, startup + roofline(b) / (share * fill(b)))`` as ``DeviceSpec.kernel_time_us``
  costs it, without the fill where the spec was fitted to measured kernels; linear in ``b``
  above the floor),
* ``O(b) = Σ_i Min(D_i(b), W_i(b)) * Min(1, 2 - u_d,i(b) - u_w,i(b))``: what overlapping
  convolution i's data gradient (length ``D_i``, fill ``u_d,i``) with its weight gradient
  (``W_i``, ``u_w,i``) saves under processor sharing,
* ``M``: the two event markers per convolution on the main stream.

A step costs about the larger of host and device time (launches run ahead of the kernels):
at small ``b`` the host dominates and the extra calls ``dC`` make it slower; in between the
device dominates and ``O(b)`` is a gain; at large ``b`` every kernel fills the device
(``u = 1``), ``O(b) = 0`` and the markers ``M`` make it slower. ``crossover`` solves
``gain(b) = 0`` on the integers (a batch size is one; ``ceiling``/``floor`` of the tiling
make ``G`` and ``O`` piecewise) and says where it helps. It is the same per-kernel model the
simulator uses, with the schedule reduced to "each weight gradient overlaps its own data
gradient"; the text puts the simulator's prediction at the captured batch beside it.

Batch scaling: a tensor whose leading dimension is the captured batch size (and that is not
a parameter, ``primals_*``) scales with ``b``; everything else is fixed. A layer with as many
channels as the batch size would be mistaken for batch-sized: capture at a batch size no
layer width equals (a model name is captured at ``batch``, default 32).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import sympy as sp
import torch
import torch.fx as fx
from sympy.utilities.lambdify import implemented_function

from fxdream import models
from fxdream.capturing import capture
from fxdream.capturing.arguments import check_inputs
from fxdream.capturing.captured import captured_parts
from fxdream.capturing.meta import meta_copy
from fxdream.ir.flops import kernel_class, node_flops, node_traffic_factor
from fxdream.ir.graphs import copy_graph_module
from fxdream.ir.nodes import is_view, node_dtype, op_name, value_of
from fxdream.passes.aux_stream_backward import split
from fxdream.runtime.streams import is_event_node
from fxdream.sim.cost.analytic import Analytic
from fxdream.sim.cost.devices import DeviceSpec, get_device
from fxdream.sim.cost.occupancy import BLOCKS_PER_SM, SPLIT_K_MIN, TILE, OccupancyAware
from fxdream.sim.prediction import graph_prediction
from fxdream.simulation import capture_for_prediction

b = sp.Symbol("b", positive=True, integer=True)
MAX_BATCH = 1024
DEFAULT_BATCH = 32  # crossover's batch for a zoo model


class Crossover(tuple):
    """``(expression, bound, text)``; also ``.definitions`` (G, O as full sympy expressions of
    ``b``), ``.interval`` (first and last helping batch, or None), ``.gain_us(batch)``."""

    def __new__(cls, expression, bound, text, definitions, interval, gain_fn):
        self = super().__new__(cls, (expression, bound, text))
        self.definitions, self.interval, self._gain_fn = definitions, interval, gain_fn
        return self

    @property
    def expression(self):
        return self[0]

    @property
    def bound(self):
        return self[1]

    @property
    def text(self):
        return self[2]

    def gain_us(self, batch: int) -> float:
        return float(self._gain_fn(batch))


@dataclass
class _Scaling:
    """Which values scale with the batch: leading dimension == captured batch, not a parameter."""
    b0: int

    def scales(self, node: fx.Node, value) -> bool:
        if not isinstance(value, torch.Tensor) or value.dim() == 0 or int(value.shape[0]) != self.b0:
            return False
        return not (isinstance(node, fx.Node) and node.op == "placeholder" and node.name.startswith("primals"))

    def nbytes(self, node, value):
        if not isinstance(value, torch.Tensor):
            return 0
        size = value.numel() * value.element_size()
        return size * b / self.b0 if self.scales(node, value) else sp.Integer(size)



def _max(*args):
    return sp.Max(*args, evaluate=False)  # unevaluated: sympy's simplification of Max is slow


def _min(*args):
    return sp.Min(*args, evaluate=False)


def _tensor_items(node: fx.Node):
    """(fx node or None, value) for every tensor a node reads and writes."""
    items = []
    for arg in node.all_input_nodes:
        leaves = torch.utils._pytree.tree_leaves(value_of(arg))
        items += [(arg, v) for v in leaves if isinstance(v, torch.Tensor)]
    out = [(node, v) for v in torch.utils._pytree.tree_leaves(value_of(node)) if isinstance(v, torch.Tensor)]
    return items, out


class _Symbolic:
    """Kernel and host times of FX nodes as sympy expressions of ``b`` (fill model + roofline)."""

    def __init__(self, device: DeviceSpec, b0: int):
        self.device, self.scaling = device, _Scaling(b0)
        self.cost = OccupancyAware(Analytic(device))
        self.slots = (device.num_sms or 1) * BLOCKS_PER_SM
        self.kmin = device.kernel_min_us

    def _batch(self, node) -> bool:
        inputs, outputs = _tensor_items(node)
        return any(self.scaling.scales(n, v) for n, v in inputs + outputs)

    def _roof(self, flops, nbytes, node):
        peak = self.cost.peak_flops(node) if isinstance(node, fx.Node) else self.device.flops(node)
        return _max(flops / peak, nbytes / self.device.mem_bandwidth) * 10**6

    def _kernel_time(self, roofline, kernel_class: str, fill=1):
        """One kernel as ``DeviceSpec.kernel_time_us`` costs it: the class's startup plus the
        roofline over its share, floored; divided by the fill only where the spec's kernel
        times do not already contain it (``DeviceSpec.kernels_measured``)."""
        share = self.device.share(kernel_class) * (1 if self.device.kernels_measured else fill)
        return _max(self.kmin, self.device.kernel_startup_us.get(kernel_class, 0.0) + roofline / share)

    def _gemm_parts(self, node) -> dict:
        """conv backward → {"dgrad"/"wgrad": (time expr, fill expr)}."""
        grad, x, w = (value_of(a) for a in node.args[:3])
        klass = kernel_class(node)
        g = max(1, int(node.args[9]))
        mask = tuple(node.args[10])
        scale_x = self.scaling.scales(node.args[1], x)
        scale_g = self.scaling.scales(node.args[0], grad)
        batch_x = b if scale_x else sp.Integer(int(x.shape[0]))
        batch_g = b if scale_g else sp.Integer(int(grad.shape[0]))
        in_pix, out_pix = math.prod(x.shape[2:]), math.prod(grad.shape[2:])
        c_in, c_out, window = int(x.shape[1]), int(grad.shape[1]), math.prod(w.shape[2:])
        nbytes = sum((self.scaling.nbytes(a, value_of(a)) for a in node.args[:3]), sp.Integer(0))
        parts = {}
        if mask[0]:
            m, n, k = batch_x * in_pix, c_in // g, c_out // g * window
            fill = _min(1, sp.ceiling(m / TILE) * math.ceil(n / TILE) * g / self.slots)
            parts["dgrad"] = (self._kernel_time(self._roof(2 * m * n * k * g, nbytes, node), klass, fill), fill)
        if mask[1]:
            m, n, k = c_out // g, c_in // g * window, batch_g * out_pix
            split = _max(1, sp.floor(k / SPLIT_K_MIN))
            fill = _min(1, math.ceil(m / TILE) * math.ceil(n / TILE) * g * split / self.slots)
            t = self._kernel_time(self._roof(2 * m * n * k * g, nbytes, node), klass, fill)
            if mask[2]:
                t = t + self._kernel_time(self.scaling.nbytes(node.args[0], grad) / self.device.mem_bandwidth * 10**6,
                                          "other")
            parts["wgrad"] = (t, fill)
        return parts

    def kernel(self, node: fx.Node):
        if is_event_node(node):
            return sp.Float(self.kmin)
        if is_view(node) or node.op != "call_function":
            return sp.Integer(0)
        name = op_name(node)
        if name == "aten.convolution_backward" and len(node.args) == 11:
            return sum((t for t, _ in self._gemm_parts(node).values()), sp.Integer(0))
        inputs, outputs = _tensor_items(node)
        nbytes = sum((self.scaling.nbytes(n, v) for n, v in inputs + outputs), sp.Integer(0))
        mnk = self._matmul(node, name)
        if mnk is not None:
            m, n, k, groups = mnk
            fill = _min(1, sp.ceiling(m / TILE) * sp.ceiling(n / TILE) * groups / self.slots)
            return self._kernel_time(self._roof(2 * m * n * k * groups, nbytes, node), kernel_class(node), fill)
        flops = node_flops(node) * (b / self.scaling.b0 if self._batch(node) else 1)
        traffic = nbytes * node_traffic_factor(node)
        return self._kernel_time(self._roof(flops, traffic, node_dtype(node)), kernel_class(node))

    def _matmul(self, node: fx.Node, name: str):
        """(M, N, K, groups) of mm / addmm / bmm / conv forward, a batch-sized dimension as ``b``."""
        def dim(arg, i):
            value = value_of(arg)
            size = int(value.shape[i])
            return b if i == 0 and self.scaling.scales(arg, value) else sp.Integer(size)
        try:
            if name in ("aten.mm", "aten.addmm"):
                a, w = node.args[-2], node.args[-1]
                return dim(a, 0), dim(w, 1), dim(w, 0) if self.scaling.scales(w, value_of(w)) else dim(a, 1), 1
            if name == "aten.bmm":
                a, w = node.args[0], node.args[1]
                return dim(a, 1), dim(w, 2), dim(a, 2), dim(a, 0)
            if name == "aten.convolution":
                x, w, out = value_of(node.args[0]), value_of(node.args[1]), value_of(node)
                g = max(1, int(node.args[8]))
                pixels = math.prod(out.shape[2:])
                batch = b if self.scaling.scales(node.args[0], x) else sp.Integer(int(out.shape[0]))
                return batch * pixels, sp.Integer(int(out.shape[1]) // g), sp.Integer(int(x.shape[1]) // g * math.prod(w.shape[2:])), g
        except (AttributeError, IndexError, TypeError):
            return None
        return None

    def host(self, node: fx.Node) -> float:
        return self.cost.dispatch_us(node)


def _backward_graphs(captured, required: bool = True) -> list[fx.GraphModule]:
    """The capture's backward graphs; ``required``: a capture without any is an error (a module
    captured here in training may have none: every op ran eagerly, as an RNN's in training)."""
    graphs = [p.backward for p in captured_parts(captured) if p.backward is not None]
    if not graphs and required:
        raise ValueError("the capture has no backward graph: capture with training=True")
    return graphs


def _captured_batch(captured, example_inputs: tuple = ()) -> int:
    """The leading size of the capture's first tensor input; of the example's first tensor where no
    graph takes one (every op ran eagerly: an RNN in training)."""
    shapes = [shape for p in captured_parts(captured) for shape in p.input_shapes]
    shapes += [tuple(x.shape) for x in torch.utils._pytree.tree_leaves(example_inputs) if isinstance(x, torch.Tensor)]
    for shape in shapes:
        if isinstance(shape, tuple) and shape:
            return int(shape[0])
    raise ValueError("cannot tell the batch size of this capture (no tensor input)")


def model_terms(graphs: list[fx.GraphModule], device: DeviceSpec, b0: int, join: str = "next") -> dict:
    """The formula's pieces for these backward graphs: C, dC, M (µs), G(b), O(b), sites."""
    sym = _Symbolic(device, b0)
    host = lambda gm: sum(sym.host(n) for n in gm.graph.nodes if n.op == "call_function")  # noqa: E731
    C = dC = M = 0.0
    G, O = sp.Integer(0), sp.Integer(0)
    sites = 0
    for gm in graphs:
        candidate, found, _ = split(copy_graph_module(gm), join)
        C += host(gm) + sym.cost.graph_call_us()
        dC += host(candidate) - host(gm)
        G += sum((sym.kernel(n) for n in gm.graph.nodes if n.op == "call_function"), sp.Integer(0))
        for site in found:
            parts = {**sym._gemm_parts(site.dgrad), **sym._gemm_parts(site.wgrad)}
            (d, ud), (w, uw) = parts["dgrad"], parts["wgrad"]
            O += _min(d, w) * _min(1, 2 - ud - uw)
            M += 2 * sym.kmin
        sites += len(found)
    return dict(C=C, dC=dC, M=M, G=G, O=O, sites=sites)


def formula(terms: dict):
    """gain(b) with G and O as named functions (evaluable: lambdify uses their full forms)."""
    G_full, O_full = terms["G"], terms["O"]
    g_fn = sp.lambdify(b, G_full, "math")
    o_fn = sp.lambdify(b, O_full, "math")
    G = implemented_function("G", g_fn)
    O = implemented_function("O", o_fn)
    C, dC, M = (sp.Float(round(terms[k], 3)) for k in ("C", "dC", "M"))
    expression = sp.Max(C, G(b)) - sp.Max(C + dC, G(b) - O(b) + M)
    return expression, {"G": G_full, "O": O_full}, sp.lambdify(b, expression, "math")


def _intervals(gains: list[tuple[int, float]]) -> list[tuple[int, int]]:
    runs, start = [], None
    for batch, g in gains:
        if g > 0 and start is None:
            start = batch
        if g <= 0 and start is not None:
            runs.append((start, batch - 1))
            start = None
    if start is not None:
        runs.append((start, gains[-1][0]))
    return runs


def crossover(model, device: str | DeviceSpec = "h100", batch: int | None = None, max_batch: int = MAX_BATCH,
              join: str = "next", simulate_at_batch: bool = True, dtype: torch.dtype = torch.float32,
              example_inputs: tuple | None = None) -> Crossover:
    """``(sympy expression of b, largest helping batch or None, text)`` for aux_stream_backward.

    ``model``: a zoo name (captured in training at ``batch``, 32 by default, and ``dtype`` on the
    meta device: no memory, no compute), an ``nn.Module`` with its ``example_inputs`` (a copy on
    the meta device is captured in training: nothing runs on their data), or a ``Captured``
    (tuple) from ``fxdream.capture(..., training=True)``; the last two at the batch they hold,
    which ``batch``, where given, must be.
    """
    spec = device if isinstance(device, DeviceSpec) else get_device(device)
    if spec.kind != "cuda":
        raise ValueError(f"aux_stream_backward's crossover needs a GPU DeviceSpec (streams), got {spec.name!r}")
    name, notes = (model if isinstance(model, str) else None), ()
    if name is not None:
        net, inputs, _ = models.build(name, batch or DEFAULT_BATCH, device="meta", dtype=dtype)
        captured = capture(net, inputs, training=True)
    elif isinstance(model, torch.nn.Module):
        if example_inputs is None:
            raise ValueError(f"crossover of a {type(model).__name__} needs its example_inputs (a tuple of "
                             f"tensors at the batch to explain): it is captured in training on the meta device")
        example_inputs = check_inputs(example_inputs)
        captured, notes = _captured_for_crossover(model, example_inputs)
    else:
        captured = model
    held = _captured_batch(captured, example_inputs or ())
    if batch is not None and batch != held:
        raise ValueError(f"batch={batch}, but the example holds batch {held}: a module or capture is explained at "
                         f"its example's batch (give example_inputs of batch {batch})")
    graphs = _backward_graphs(captured, required=not isinstance(model, torch.nn.Module))
    found = crossover_of_graphs(graphs, spec, held, name, max_batch, join, simulate_at_batch)
    if not notes:
        return found
    text = found.text + "".join(f"\n  note: {note}" for note in notes)
    return Crossover(found.expression, found.bound, text, found.definitions, found.interval, found._gain_fn)


def _captured_for_crossover(model: torch.nn.Module, inputs: tuple) -> tuple:
    """(the training capture of ``model`` on a meta copy of it and ``inputs``, notes): as ``simulate``
    captures for a GPU, so a model whose capture on the meta device fails (it reads tensor values, or
    takes lengths on the CPU) is captured on the example's data instead, with a note saying so."""
    net, meta_inputs, _ = meta_copy(model, inputs)
    _, captured, _, notes = capture_for_prediction((model, inputs), net.train(), meta_inputs, training=True)
    return captured, notes


def crossover_of_graphs(graphs: list[fx.GraphModule], device: DeviceSpec, b0: int, name: str | None = None,
                        max_batch: int = MAX_BATCH, join: str = "next", simulate_at_batch: bool = True) -> Crossover:
    """``crossover`` for backward graphs captured at batch ``b0``."""
    spec = device
    who = f"{name}: " if name else ""
    terms = model_terms(graphs, spec, b0, join)
    expression, definitions, gain_fn = formula(terms)
    if terms["sites"] == 0:
        text = f"{who}no convolution_backward with data and weight gradients: aux_stream_backward has nothing to split"
        return Crossover(expression, None, text, definitions, None, gain_fn)
    g_fn = sp.lambdify(b, terms["G"], "math")
    gains = [(n, gain_fn(n)) for n in range(1, max_batch + 1)]
    runs = _intervals(gains)
    first = runs[0] if runs else None
    bound = first[1] if first else None
    best_batch, best_gain = max(gains, key=lambda item: item[1] / max(g_fn(item[0]), terms["C"]))
    where = f"on {spec.name}"
    if first is None:
        head = f"{who}aux_stream_backward is predicted never to help {where} (batch 1..{max_batch})"
    else:
        low = "" if first[0] == 1 else f"{first[0]} ≤ "
        head = f"{who}aux_stream_backward is predicted to help for {low}batch ≤ {first[1]} {where}"
        if len(runs) > 1:
            head += " (also " + ", ".join(f"{lo}..{hi}" for lo, hi in runs[1:4]) + ")"
    g0 = g_fn(b0)
    lines = [head,
             f"  gain(b) = Max(C, G(b)) - Max(C + dC, G(b) - O(b) + M) µs, {terms['sites']} convolutions split:",
             f"  C = {terms['C'] / 1e3:.3f} ms host time, dC = {terms['dC'] / 1e3:+.3f} ms (event calls, one more "
             f"call per convolution), M = {terms['M'] / 1e3:.3f} ms (two event markers each on stream 0),",
             f"  G(b) = backward kernel time ({g0 / 1e3:.3f} ms at b = {b0}), O(b) = Σ Min(D_i, W_i)·Min(1, 2 - u_d,i - "
             f"u_w,i) (overlap under contention; u = fill of the device, from the GEMM tiling)",
             f"  at b = {b0}: formula {gain_fn(b0):+.1f} µs ({100 * gain_fn(b0) / max(g0, terms['C']):+.2f} %)"
             + (_simulated(graphs, spec, join) if simulate_at_batch else "")]
    if first is not None:
        lines.append(f"  largest relative gain at b = {best_batch}: {best_gain:+.1f} µs "
                     f"({100 * best_gain / max(g_fn(best_batch), terms['C']):+.2f} %)")
    return Crossover(expression, bound, "\n".join(lines), definitions, first, gain_fn)


def _simulated(graphs, spec: DeviceSpec, join: str) -> str:
    cost = OccupancyAware(Analytic(spec))
    before = after = 0.0
    for gm in graphs:
        before += graph_prediction(gm, cost, "bw")[0]
        after += graph_prediction(split(copy_graph_module(gm), join)[0], cost, "bw")[0]
    return f"; simulator {before - after:+.1f} µs ({100 * (before - after) / before:+.2f} %)"


__all__ = ["Crossover", "b", "crossover", "crossover_of_graphs", "formula", "model_terms"]
