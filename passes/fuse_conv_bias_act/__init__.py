"""fuse_conv_bias_act: conv (+bias) (+BN folded) (+residual add) + ReLU (in CPU inference also SiLU, ReLU6,
hardswish, sigmoid, tanh) as one fused kernel.

The Flux seed (FluxML/Flux.jl#558) and cuDNN's ``cudnnConvolutionBiasActivationForward``:
match, at ATen level, ``convolution(+bias) → [add residual] → relu`` and, in inference
with frozen weights, ``convolution → batch_norm → [add] → [relu]`` with the batch norm
folded into the conv's weight and bias (w' = w·γ/√(σ²+ε), b' = β + (b − μ)·γ/√(σ²+ε)).

Fusion is not always faster (oneDNN's fused conv in NCHW can be slower than the unfused ops,
cuDNN's fused call 17x slower on some 7x7 channels_last convs, pytorch#68506), so the pass
builds every variant the device allows (CPU inference: NCHW, channels_last + weights prepacked
once; CUDA: NCHW, channels_last) and keeps the fastest by ``ctx.predict_us`` (the pipeline's measured cost model);
every variant's predicted time goes in the notes. When none is predicted faster than the graph
as it is, the pass declines under ``passes="auto"``; named explicitly (forced), it applies the
fastest variant and says it is predicted slower, so an A/B run can check that prediction too
(declining there too, a predicted loss would never be measured). Without a cost
model it takes channels_last + prepacked on CPU and NCHW on CUDA and says so. Training graphs
get the trainable ops (``fxdream::conv_bias_relu``, ``fxdream::conv_bias_add_relu``) in NCHW:
the forward returns exactly the values the already-built backward graph expects.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_map

from fxdream.ir.aliasing import aliases_input
from fxdream.ir.nodes import draws_random_numbers
from fxdream.ops import fused_conv as ops
from fxdream.pass_api import (
    LAYER,
    Note,
    PassBase,
    PassContext,
    PassResult,
    choose,
    copy_graph_module,
    frozen_value,
    real_tensors,
    register_pass,
    value_of,
)
from fxdream.passes.fuse_conv_bias_act.sites import SKIPPED, Site, find_sites, fusable_acts, onednn_act
from fxdream.runtime.onednn_direct import call_onednn_directly

CLONE = torch.ops.aten.clone.default
NCHW = torch.contiguous_format
TRAINABLE = (torch.ops.fxdream.conv_bias_relu.default, torch.ops.fxdream.conv_bias_add_relu.default)


@dataclass(frozen=True)
class Variant:
    name: str
    channels_last: bool = False
    prepack: bool = False


NCHW_FUSED = Variant("nchw")
CHANNELS_LAST = Variant("channels_last", channels_last=True)
PREPACKED = Variant("channels_last+prepacked", channels_last=True, prepack=True)


def fold_batch_norm(weight, bias, gamma, beta, mean, var, eps: float):
    """(w', b') with the batch norm folded in; the per-channel terms in float64."""
    scale = torch.rsqrt(var.double() + eps)
    if gamma is not None:
        scale = scale * gamma.double()
    # in float32 at least: a bf16 weight is scaled before it is rounded once more
    folded_w = (weight.float() * scale.float().reshape(-1, *([1] * (weight.dim() - 1)))).to(weight.dtype)
    b0 = bias.double() if bias is not None else torch.zeros_like(mean, dtype=torch.float64)
    folded_b = (b0 - mean.double()) * scale
    if beta is not None:
        folded_b = folded_b + beta.double()
    return folded_w, folded_b.to(weight.dtype)


class _Builder:
    """Builds one variant's graph from a copy: rewrite sites, then re-derive fake values."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext, variant: Variant, folded: dict | None = None):
        self.gm, self.ctx, self.variant = copy_graph_module(gm), ctx, variant
        self.folded = {} if folded is None else folded  # conv name → (w', b'), shared by the variants
        self.graph = self.gm.graph
        self.original = {n.name: value_of(n) for n in self.graph.nodes}
        self.fake_mode = next(v.fake_mode for v in self.original.values() if isinstance(v, FakeTensor))
        self.stand_ins: dict[str, torch.Tensor] = {}   # get_attr target → fake tensor (for packed weights)

    def build(self, sites: list[Site]) -> fx.GraphModule:
        for site in sites:
            self._rewrite(site)
        if self.ctx.frozen:
            self._propagate()
        self.graph.lint()
        self.gm.recompile()
        if self.variant.prepack:
            call_onednn_directly(self.gm)
        return self.gm

    # --- one site ---------------------------------------------------------------------------
    def _rewrite(self, site: Site) -> None:
        conv = site.conv
        x, w, b = conv.args[:3]
        stride, padding, dilation, groups = conv.args[3], conv.args[4], conv.args[5], conv.args[8]
        other = site.add.args[site.other_index] if site.add is not None else None
        with self.graph.inserting_before(site.last):
            if not self.ctx.frozen:
                target = TRAINABLE[1] if other is not None else TRAINABLE[0]
                args = (x, w, b) + ((other,) if other is not None else ()) + (stride, padding, dilation, groups)
            else:
                w, b = self._frozen_weights(site, x, w, b, stride, padding, dilation, groups)
                packed = w.op == "get_attr" and getattr(self.gm, w.target).is_mkldnn
                target = ops.conv_fused_inference_prepacked if packed else ops.conv_fused_inference
                act = onednn_act(site.act, fusable_acts(self.ctx)) if site.act is not None else "none"
                args = (x, w, b, other, stride, padding, dilation, groups, act)
            fused = self.graph.call_function(target, args)
        fused.meta.update(conv.meta)
        if not self.ctx.frozen:  # frozen graphs re-derive every value in _propagate
            fused.meta["val"] = self._fake_run(fused)
        self.original[fused.name] = self.original.get(site.last.name)  # the layout to give back
        site.last.replace_all_uses_with(fused)
        for node in (site.act, site.add, site.bn_out, site.bn, conv):
            if node is not None:
                self.graph.erase_node(node)

    def _frozen_weights(self, site, x, w, b, stride, padding, dilation, groups):
        """Folded / channels_last / prepacked weights as constants, where the weights are known."""
        params = self.ctx.params
        weight, bias = frozen_value(w, self.ctx), frozen_value(b, self.ctx)
        if weight is None or (b is not None and bias is None):
            return w, b  # not constants: use them as they come, in whatever layout
        with real_tensors(), torch.no_grad():
            weight, bias = weight.detach(), None if bias is None else bias.detach()
            if site.bn is not None:
                if site.conv.name not in self.folded:
                    stats = (None if a is None else params[a.name].detach() for a in site.bn.args[1:5])
                    self.folded[site.conv.name] = fold_batch_norm(weight, bias, *stats, site.bn.args[6])
                weight, bias = self.folded[site.conv.name]
            elif not self.variant.channels_last:
                return w, b  # nothing to change: the live placeholders
            fmt = (self.variant.channels_last and ops.channels_last_format(weight.dim())) or NCHW
            if self.variant.prepack and ops.can_prepack(value_of(x), weight):
                value = ops.prepack_conv_weight(weight, stride, padding, dilation, groups, value_of(x).shape)
            else:
                value = weight.contiguous(memory_format=fmt)
            stand_in = self._fake_like(weight, fmt)
        w_node = self._constant(site, "weight", value, stand_in)
        b_node = None if bias is None else self._constant(site, "bias", bias, None)
        return w_node, b_node

    def _constant(self, site: Site, what: str, tensor: torch.Tensor, stand_in) -> fx.Node:
        name = f"_fxdream_{site.conv.name}_{what}"
        while hasattr(self.gm, name):
            name += "_"
        self.gm.register_buffer(name, tensor, persistent=False)
        node = self.graph.get_attr(name)
        node.meta.update({"val": tensor, LAYER: site.conv.meta.get(LAYER, "")})
        if stand_in is not None:
            self.stand_ins[name] = stand_in
        return node

    # --- fake values and layouts -------------------------------------------------------------
    def _fake_of(self, node: fx.Node):
        if node.op == "get_attr":
            if node.target not in self.stand_ins:
                value = value_of(node)
                if value is None:
                    value = getattr(self.gm, node.target)
                self.stand_ins[node.target] = value if isinstance(value, FakeTensor) else self._fake_like(value)
            return self.stand_ins[node.target]
        return value_of(node)

    def _fake_like(self, t: torch.Tensor, fmt=None) -> torch.Tensor:
        """A fake tensor with ``t``'s shape and strides, or ``fmt`` (no symbols added to the shape env)."""
        with self.fake_mode:
            if fmt is not None:
                return torch.empty(tuple(t.shape), dtype=t.dtype, device=t.device).contiguous(memory_format=fmt)
            return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=t.device)

    def _fake_run(self, node: fx.Node):
        args, kwargs = tree_map(lambda a: self._fake_of(a) if isinstance(a, fx.Node) else a, (node.args, node.kwargs))
        with self.fake_mode:
            return node.target(*args, **kwargs)

    def _propagate(self) -> None:
        """Re-derive every value's fake tensor in order (strides change with channels_last);
        convert conv inputs to channels_last (channels_last_3d) once, and back to the original
        layout before any view (views depend on strides), any op drawing random numbers (which
        number lands in which element follows memory order: dropout's mask, ``randn_like``, as
        eager draws them) and at the outputs; a 1-d conv's input
        is converted inside the op, and its (N, L, C) output back before any op but a pointwise
        one or another fused conv: (N, L, C) is no memory format ATen knows, and CPU kernels
        such as GroupNorm's reject it (in Wav2Vec2's feature encoder, say)."""
        converted: dict[tuple[str, object], fx.Node] = {}
        for node in list(self.graph.nodes):
            if node.op in ("placeholder", "get_attr"):
                continue
            if node.op == "output":
                node.args = tree_map(lambda a: self._restore(a, node, converted) if isinstance(a, fx.Node) else a,
                                     node.args)
                continue
            if self.variant.channels_last and node.target in ops.INFERENCE_OPS:
                fmt = ops.channels_last_format(value_of(node.args[0]).dim())  # 1-d: inside the op
                node.args = (self._convert(node.args[0], fmt, node, converted),) + tuple(node.args[1:])
            elif aliases_input(node) or draws_random_numbers(node):  # e.g. the view before a classifier
                node.args = tree_map(lambda a: self._restore(a, node, converted) if isinstance(a, fx.Node) else a,
                                     node.args)
            elif node.op == "call_function" and not _takes_nlc(node.target):
                node.args, node.kwargs = tree_map(
                    lambda a: self._restore(a, node, converted) if self._is_nlc(a) else a, (node.args, node.kwargs))
            if node.op == "call_function":
                node.meta["val"] = self._fake_run(node)

    def _is_nlc(self, arg) -> bool:
        """Whether ``arg`` is a 1-d conv's output in (N, L, C) strides where the graph had it contiguous."""
        before, now = self.original.get(arg.name) if isinstance(arg, fx.Node) else None, value_of(arg)
        return (isinstance(before, torch.Tensor) and isinstance(now, torch.Tensor) and before.dim() == 3
                and before.is_contiguous() and not now.is_contiguous())

    def _restore(self, arg: fx.Node, user: fx.Node, converted) -> fx.Node:
        before, now = self.original.get(arg.name), value_of(arg)
        if not isinstance(before, torch.Tensor) or not isinstance(now, torch.Tensor):
            return arg
        if self._is_nlc(arg):
            return self._convert(arg, NCHW, user, converted)
        channels_last = ops.channels_last_format(before.dim())
        if channels_last is None:
            return arg
        fmt = NCHW if before.is_contiguous() else channels_last if before.is_contiguous(
            memory_format=channels_last) else None
        if fmt is None:
            if now.stride() != before.stride():
                raise ValueError(f"cannot restore the layout of {arg.name} (strides {before.stride()})")
            return arg
        return self._convert(arg, fmt, user, converted)

    def _convert(self, arg: fx.Node, fmt, user: fx.Node, converted) -> fx.Node:
        value = value_of(arg)
        if fmt is None or not isinstance(value, torch.Tensor) or value.is_contiguous(memory_format=fmt) \
                or fmt not in (NCHW, ops.channels_last_format(value.dim())):
            return arg
        key = (arg.name, fmt)
        if key not in converted:
            with self.graph.inserting_before(user):
                node = self.graph.call_function(CLONE, (arg,), {"memory_format": fmt})
            node.meta.update({LAYER: user.meta.get(LAYER, arg.meta.get(LAYER, "")), "val": None})
            node.meta["val"] = self._fake_run(node)
            converted[key] = node
        return converted[key]


def _variants(ctx: PassContext, sites: list[Site]) -> tuple[Variant, ...]:
    """By the target device (a GPU spec planned on a CPU machine gets the GPU variants). On CPU,
    prepacked is channels_last minus the per-call weight reorders (a weight that cannot be
    packed stays channels_last in it): timing both only lets noise pick the worse. On CPU
    every fused conv can be packed (a 1-d one runs as 2-d over height 1); channels_last on
    CUDA is for 2-d and 3-d convs. The one usually fastest comes first: a candidate clearly
    slower than one timed before it is timed in two runs, not three (``PassPipeline``)."""
    if not ctx.frozen:
        return (NCHW_FUSED,)
    if ctx.device == "cpu":
        return (PREPACKED, NCHW_FUSED)
    dims = {value_of(s.conv.args[0]).dim() for s in sites}
    return (NCHW_FUSED, CHANNELS_LAST) if dims & {4, 5} else (NCHW_FUSED,)


# A variant whose floor is this much over the best variant timed before it is not built: the
# floor is already optimistic (a variant's timed cost is above it), so a small margin suffices.
FLOOR_MARGIN = 1.1


def _floor_us(ctx: PassContext, variant: Variant, sites: list[Site], base_us: float) -> float | None:
    """The least a CPU variant in the graph's own layout can take: the unfused graph minus the
    ops fusion removes (BN, add, activation), as a fused oneDNN conv in NCHW runs no faster than
    aten's conv. None where no floor is known (channels_last variants, GPUs, no per-op costs).
    Building and timing a variant that cannot win is a large share of a first build."""
    cost = ctx.cost_model
    if variant.channels_last or ctx.device != "cpu" or cost is None:
        return None
    removed = [n for s in sites for n in (s.bn, s.bn_out, s.add, s.act) if n is not None]
    return base_us - sum(cost.kernel_us(n) + cost.dispatch_us(n) for n in removed)


def _takes_nlc(target) -> bool:
    """Ops that run on a 1-d conv's (N, L, C) output as they are: the fused convs and pointwise
    ops (their output follows the input's strides)."""
    return target in ops.INFERENCE_OPS or torch.Tag.pointwise in getattr(target, "tags", ())


def _default(ctx: PassContext, sites: list[Site]) -> Variant:
    return PREPACKED if PREPACKED in _variants(ctx, sites) else NCHW_FUSED


def _summary(sites: list[Site]) -> str:
    return ", ".join(f"{n} {kind}" for kind, n in Counter(s.kind for s in sites).items())


@register_pass
class FuseConvBiasAct(PassBase):
    name = "fuse_conv_bias_act"
    phases = ("fw",)
    why_not = MappingProxyType({"phase": "rewrites forward graphs; the backward is unchanged",
                                "device": "no fused conv kernels for device {device!r}"})

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        sites, notes = find_sites(gm.graph, ctx)
        if not sites:
            skipped = Counter(n.detail for n in notes if isinstance(n, Note) and n.kind == SKIPPED)
            why = "; ".join(f"{k} convolution(s): {problem}" for problem, k in skipped.items())
            return PassResult(gm, False, "no conv+bias+relu, conv+add+relu or conv+bn pattern to fuse"
                              + (f" ({why})" if why else ""), tuple(notes))
        if ctx.predict_us is None:  # without a cost model there is nothing to compare: the default variant
            chosen = _default(ctx, sites)
            try:
                built = self._build(gm, ctx, chosen)
            except Exception as error:
                return PassResult(gm, False, "no fused variant could be built",
                                  tuple(notes + [f"variant {chosen.name} not built: {type(error).__name__}: {error}"]))
            return PassResult(built, True, f"fused {_summary(sites)}; {chosen.name}: no cost model was given, "
                              "so chosen by default", tuple(notes + [f"{s.layer}: {s.kind}" for s in sites]))
        base = ctx.predict_us(gm)
        candidates, times, failed = self._costed_variants(gm, ctx, sites, base)
        if not times:
            return PassResult(gm, False, f"no fused variant could be {'costed' if candidates else 'built'}",
                              tuple(notes + failed))
        choice = choose(ctx, base, times)
        listing = ", ".join([f"unfused {base / 1e3:.3f} ms"] + [f"{v.name} {t / 1e3:.3f} ms" for v, t in times.items()])
        if choice.chosen is None:
            return PassResult.unchanged(gm, f"every fused variant is predicted slower than unfused ({listing})",
                                        [Note("", f"predicted: {listing} → unfused")] + notes + failed)
        chosen = choice.chosen
        notes.insert(0, Note("", f"predicted: {listing} → {chosen.name}" + (" (forced)" if choice.forced else "")))
        how = f"{chosen.name} ({'forced: ' if choice.forced else ''}predicted {choice.speedup:.2f}x)"
        return PassResult.changed(candidates[chosen], f"fused {_summary(sites)}; {how}",
                                  notes + failed + [Note(s.layer, s.kind, "fused") for s in sites])

    def _costed_variants(self, gm: fx.GraphModule, ctx: PassContext, sites: list[Site], base: float):
        """({variant: graph}, {variant: predicted µs}, notes on variants left out), in the order
        ``_variants`` gives. A variant whose floor (``_floor_us``) is over ``FLOOR_MARGIN`` times
        the best time so far is neither built nor timed."""
        candidates, times, failed, folded = {}, {}, [], {}
        for variant in _variants(ctx, sites):
            floor = _floor_us(ctx, variant, sites, base)
            if times and floor is not None and floor > FLOOR_MARGIN * min(times.values()):
                best = min(times, key=times.get)
                failed.append(f"variant {variant.name} not built: at least {floor / 1e3:.3f} ms (unfused minus "
                              f"the ops fusion removes), {floor / times[best]:.2f}x {best.name}")
                continue
            try:
                candidates[variant] = self._build(gm, ctx, variant, folded)
            except Exception as error:  # a variant that cannot be built is reported, not fatal
                failed.append(f"variant {variant.name} not built: {type(error).__name__}: {error}")
                continue
            try:
                times[variant] = ctx.predict_us(candidates[variant])
            except Exception as error:  # cannot be costed: not a candidate
                failed.append(f"variant {variant.name} not predicted: {type(error).__name__}: {error}")
        return candidates, times, failed

    @staticmethod
    def _build(gm: fx.GraphModule, ctx: PassContext, variant: Variant, folded: dict | None = None) -> fx.GraphModule:
        builder = _Builder(gm, ctx, variant, folded)
        sites, _ = find_sites(builder.graph, ctx)
        return builder.build(sites)
