"""prepack_linear: in CPU inference, a linear layer as a linear kernel with its weight prepacked
once (oneDNN's, with a ReLU, GELU or SiLU right after it as its post-op, or MKL's packed GEMM).

What inductor's CPU freezing does for linear layers (it uses MKL's for float32). At ATen level
a linear is ``addmm(bias, x, t(w))`` (``mm(x, t(w))`` without bias; a 3-d input is viewed to
2-d around it), and a layer that keeps its weight as (in, out) (Hugging Face's ``Conv1D`` in
GPT-2 and its kin) is ``addmm(bias, x, w)``: its packed weight is made from ``w.t()``. With
``w`` a known constant (inference) it becomes ``mkldnn._linear_pointwise(x,
packed, bias, act)`` with ``packed = mkldnn._reorder_linear_weight(w, rows)`` made at build
time (oneDNN's blocked layout, the same size as ``w``), or ``mkl._mkl_linear`` with MKL's packed
buffer, which can be several times the weight's size (hundreds of times for a small weight):
tried only up to 4x. Which is fastest depends on the shape: packing wins on large layers, either
kind may win, and on a one-row classifier addmm can beat both. So one site of each shape is timed
all ways (``Profiled.isolated_us``) and each site takes the fastest; under ``passes="auto"`` the
pass then declines unless the graph, timed in context, is predicted faster than without. Named
explicitly (forced), it packs every site by its faster kind and applies, saying where that is
predicted slower. Without measured costs it packs (oneDNN) the sites with more than one row and
says so.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.fx as fx

from fxdream.ops import fused_conv as ops
from fxdream.pass_api import (
    LAYER,
    PassBase,
    PassContext,
    PassResult,
    copy_graph_module,
    frozen_value,
    kept_if_faster,
    real_tensors,
    register_pass,
)
from fxdream.sim.cost.profiled import Profiled

aten = torch.ops.aten
ADDMM, MM, T = aten.addmm.default, aten.mm.default, aten.t.default
VIEWS = (aten.view.default, aten._unsafe_view.default)
LINEAR = ops.ONEDNN_LINEAR.default if ops.ONEDNN_LINEAR is not None else None
MKL_LINEAR = ops.MKL_LINEAR.default if ops.MKL_LINEAR is not None else None  # None: a build without MKL
ONEDNN, MKL = "oneDNN", "MKL"
MKL_MAX_GROWTH = 4.0  # MKL's packed buffer at most 4x the weight (a small weight's can be hundreds of times its size)


@dataclass
class Site:
    """``mm`` is the addmm/mm node, ``weight`` its weight's placeholder; ``act`` a ReLU/GELU/SiLU
    after it (through ``view``, a reshape back to 3-d). ``transposed``: the weight is stored as
    (in, out), the product's right operand itself (``Conv1D``), not (out, in) behind a ``t``."""
    mm: fx.Node
    weight: fx.Node
    view: fx.Node | None = None
    act: fx.Node | None = None
    kind: str = ONEDNN  # whose packed linear: oneDNN's (the activation fused) or MKL's
    transposed: bool = False

    def weight_shape(self, ctx: PassContext) -> tuple[int, int]:
        """(out, in), as a linear layer holds its weight."""
        rows, columns = frozen_value(self.weight, ctx).shape
        return (columns, rows) if self.transposed else (rows, columns)

    @property
    def layer(self) -> str:
        return self.mm.meta.get(LAYER) or self.mm.name

    @property
    def rows(self) -> int:
        return int(self.mm.meta["val"].shape[0])

    def operands(self) -> tuple:
        """(x, bias) as the graph has them now (an earlier site's rewrite may have replaced x)."""
        return (self.mm.args[1], self.mm.args[0]) if self.mm.target is ADDMM else (self.mm.args[0], None)


def _post_op(node: fx.Node) -> tuple[str, list, str] | None:
    """oneDNN's (attr, scalars, algorithm) for an activation node, or None."""
    if node.op != "call_function":
        return None
    if node.target is aten.relu.default:
        return "relu", [], ""
    if node.target is aten.gelu.default and not node.args[1:]:
        return "gelu", [], node.kwargs.get("approximate", "none")
    if node.target is aten.silu.default:
        return "swish", [], ""
    return None


def _constant(node, ctx: PassContext, dims: int) -> bool:
    """A frozen CPU weight of ``dims`` dimensions in float32, or in bf16 where oneDNN runs it."""
    value = frozen_value(node, ctx)
    return isinstance(value, torch.Tensor) and value.dim() == dims and value.device.type == "cpu" \
        and (value.dtype == torch.float32 or value.dtype == torch.bfloat16 and _bf16_linear())


def _bf16_linear() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def find_sites(graph: fx.Graph, ctx: PassContext) -> tuple[list[Site], list[str]]:
    sites, notes = [], []
    for node in graph.nodes:
        if node.op != "call_function" or node.target not in (ADDMM, MM) or node.kwargs:
            continue  # addmm with beta/alpha is not a linear layer
        bias, x, wt = (node.args if node.target is ADDMM else (None, *node.args))
        transposed = isinstance(wt, fx.Node) and wt.target is not T
        weight = wt if transposed else wt.args[0] if isinstance(wt, fx.Node) else None
        if weight is None or not _constant(weight, ctx, 2):
            continue  # a product of two activations (attention), not a layer
        value = x.meta.get("val") if isinstance(x, fx.Node) else None
        weight_dtype = frozen_value(weight, ctx).dtype
        if bias is not None and not _constant(bias, ctx, 1) or not isinstance(value, torch.Tensor) \
                or value.dtype != weight_dtype:
            notes.append(f"{node.meta.get(LAYER) or node.name}: skipped: bias not a constant or input not in the "
                         f"weight's dtype")
            continue
        if isinstance(node.meta["val"].shape[0], torch.SymInt):  # reading it would fix the size for the graph
            notes.append(f"{node.meta.get(LAYER) or node.name}: skipped: its row count is dynamic (a packed "
                         f"weight is packed for one)")
            continue
        site = Site(node, weight, transposed=transposed)
        after = list(node.users)
        if len(after) == 1 and after[0].op == "call_function" and after[0].target in VIEWS:
            site.view, after = after[0], list(after[0].users)
        if len(after) == 1 and _post_op(after[0]) is not None:
            site.act = after[0]
        sites.append(site)
    return sites, notes


def _rewrite(gm: fx.GraphModule, sites: list[Site], ctx: PassContext, packs: dict) -> dict[str, fx.Node]:
    """Each site's linear as a packed op (``site.kind``'s); returns the old node's name → the new node.
    ``packs`` keeps the packed weights by ``_pack_key`` for a second rewrite of the graph."""
    graph, new = gm.graph, {}
    for site in sites:
        packed = _packed(site, ctx, packs)
        name = f"_fxdream_{site.mm.name}_packed_weight"
        while hasattr(gm, name):
            name += "_"
        gm.register_buffer(name, packed, persistent=False)
        with graph.inserting_before(site.mm):
            w_node = graph.get_attr(name)
            w_node.meta.update({"val": packed, LAYER: site.mm.meta.get(LAYER, "")})
            x, bias = site.operands()
            if site.kind == MKL:  # no post-ops: the activation stays; MKL reads the (out, in) shape
                weight = site.weight
                if site.transposed:
                    weight = graph.call_function(T, (site.weight,))
                    weight.meta.update({"val": site.weight.meta["val"].t(), LAYER: site.mm.meta.get(LAYER, "")})
                linear = graph.call_function(MKL_LINEAR, (x, w_node, weight, bias, site.rows))
            else:
                attr, scalars, algorithm = _post_op(site.act) if site.act is not None else ("none", [], "")
                linear = graph.call_function(LINEAR, (x, w_node, bias, attr, scalars, algorithm))
        linear.meta.update(site.mm.meta)
        wt = site.mm.args[-1]
        site.mm.replace_all_uses_with(linear)
        graph.erase_node(site.mm)
        if wt.op == "call_function" and not wt.users:
            graph.erase_node(wt)
        if site.act is not None and site.kind == ONEDNN:  # applied inside: the view (if any) now carries it
            site.act.replace_all_uses_with(site.view if site.view is not None else linear)
            graph.erase_node(site.act)
        new[site.mm.name] = linear
    graph.lint()
    gm.recompile()
    return new


def _pack_key(site: Site, ctx: PassContext) -> tuple:
    """Sites sharing a weight (held the same way) at the same rows share its packed buffer."""
    return id(frozen_value(site.weight, ctx)), site.transposed, site.rows, site.kind


def _packed(site: Site, ctx: PassContext, packs: dict) -> torch.Tensor:
    key = _pack_key(site, ctx)
    if key not in packs:
        with real_tensors(), torch.no_grad():
            reorder = torch.ops.mkl._mkl_reorder_linear_weight if site.kind == MKL else \
                torch.ops.mkldnn._reorder_linear_weight
            weight = frozen_value(site.weight, ctx).detach()
            packs[key] = reorder((weight.t() if site.transposed else weight).contiguous(), site.rows)
    return packs[key]


def _shape(site: Site, ctx: PassContext) -> tuple:
    """What the site's timing depends on: rows, weight shape, input strides, bias, post-op."""
    x, bias = site.operands()
    act = _post_op(site.act) if site.act is not None else ("none", [], "")
    return (site.rows, site.weight_shape(ctx), tuple(x.meta["val"].stride()),
            bias is not None, act[0], act[2])


def _describe(site: Site, ctx: PassContext, count: int) -> str:
    out_features, in_features = site.weight_shape(ctx)
    act = f" + {site.act.target.overloadpacket.__name__}" if site.act is not None else ""
    like = f" (and {count - 1} more of its shape)" if count > 1 else ""
    return (f"{site.layer}{like}: {site.rows} row{'s' if site.rows != 1 else ''}, {in_features} → "
            f"{out_features}{act}")


def _trial(gm: fx.GraphModule, sites: list[Site], kind: str, ctx: PassContext, packs: dict) -> dict[str, fx.Node]:
    """``sites`` packed by ``kind`` in a copy of ``gm``: the old node's name → its packed op."""
    trial = copy_graph_module(gm)
    by_name = {n.name: n for n in trial.graph.nodes}
    same = lambda node: None if node is None else by_name[node.name]  # noqa: E731
    return _rewrite(trial, [dataclasses.replace(s, mm=same(s.mm), weight=same(s.weight), view=same(s.view),
                                                act=same(s.act), kind=kind) for s in sites], ctx, packs)


def _mkl_fits(site: Site, ctx: PassContext, packs: dict) -> bool:
    weight = frozen_value(site.weight, ctx)
    return MKL_LINEAR is not None and weight.dtype == torch.float32 and \
        _packed(dataclasses.replace(site, kind=MKL), ctx, packs).numel() <= MKL_MAX_GROWTH * weight.numel()


def _faster_packed(gm: fx.GraphModule, sites: list[Site], ctx: PassContext,
                   packs: dict) -> tuple[list[Site], list[str]]:
    """The sites to pack, each with the kind whose op, timed alone at its shapes, beat addmm (+ the
    activation) and the other kind: one site of each shape is packed in trial copies and timed."""
    cost = ctx.cost_model
    if not isinstance(cost, Profiled):
        return [s for s in sites if s.rows > 1], [
            f"{s.layer}: no measured costs: " + (f"packed by oneDNN ({s.rows} rows)" if s.rows > 1 else
                                                 "left as it was (1 row: packing was slower here)") for s in sites]
    groups: dict[tuple, list[Site]] = {}
    for site in sites:
        groups.setdefault(_shape(site, ctx), []).append(site)
    firsts = [group[0] for group in groups.values()]
    onednn = _trial(gm, firsts, ONEDNN, ctx, packs)
    mkl = _trial(gm, [s for s in firsts if _mkl_fits(s, ctx, packs)], MKL, ctx, packs)
    keep, notes = [], []
    for site, group in zip(firsts, groups.values()):
        act_us = cost.isolated_us(site.act) if site.act is not None else 0.0
        times = {"as captured": cost.isolated_us(site.mm) + act_us, ONEDNN: cost.isolated_us(onednn[site.mm.name])}
        if site.mm.name in mkl:
            times[MKL] = cost.isolated_us(mkl[site.mm.name]) + act_us
        best = min(times, key=times.get)
        if best == "as captured" and ctx.forced:  # named: pack every site, by its faster kind
            best = min((k for k in times if k != "as captured"), key=times.get)
        listing = ", ".join(f"{k} {v:.0f} µs" for k, v in times.items())
        unfit = "" if MKL in times else " (MKL's packed buffer would exceed 4x the weight)" \
            if MKL_LINEAR is not None else " (no MKL in this torch)"
        forced = " (forced: slower alone)" if best != "as captured" and times[best] > times["as captured"] else ""
        notes.append(f"{_describe(site, ctx, len(group))}: {listing}{unfit} (alone) → "
                     + ("left as it was" if best == "as captured" else f"packed by {best}{forced}"))
        if best != "as captured":
            keep.extend(dataclasses.replace(s, kind=best) for s in group)
    used = {_pack_key(s, ctx) for s in keep}
    for key in [k for k in packs if k not in used]:
        del packs[key]  # let the trials' other buffers go now
    return keep, notes


_FROZEN_ONLY = "inference forward graphs only (the weights must be constants)"


@register_pass
class PrepackLinear(PassBase):
    name = "prepack_linear"
    devices, modes, phases = ("cpu",), ("inference",), ("fw",)
    why_not = MappingProxyType({"device": "CPU only (oneDNN's packed linear)",
                                "mode": _FROZEN_ONLY, "phase": _FROZEN_ONLY})

    def requires(self, ctx: PassContext) -> str | None:
        if not torch.backends.mkldnn.is_available() or LINEAR is None:
            return "this torch has no oneDNN (its packed linear)"
        return None

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        sites, notes = find_sites(gm.graph, ctx)
        if not sites:
            return PassResult(gm, False, "no linear layer with constant float32 (or bf16) weights", tuple(notes))
        original = copy_graph_module(gm) if ctx.predict_us is not None else None
        packs: dict = {}
        keep, choice = _faster_packed(gm, sites, ctx, packs)
        notes = choice + notes
        if not keep:
            return PassResult(gm, False, f"packing is not faster at any of the {len(sites)} linear layer(s)"
                              + ("" if isinstance(ctx.cost_model, Profiled) else " (no measured costs: none has "
                                 "more than one row)"), tuple(notes))
        _rewrite(gm, keep, ctx, packs)
        kinds = Counter(s.kind for s in keep)
        acts = sum(s.act is not None and s.kind == ONEDNN for s in keep)
        what = (f"packed {len(keep)} of {len(sites)} linear layer(s) ("
                + ", ".join(f"{n} by {kind}" for kind, n in kinds.items()) + ")"
                + (f", {acts} with the activation fused" if acts else ""))
        return kept_if_faster(ctx, original, gm, what, notes)
