"""Fuse attention spelled out as matmul → scale → (+ mask) → softmax → matmul into one SDPA call.

Models written before ``F.scaled_dot_product_attention`` (BERT as Hugging Face wrote it, most
seq2seq code) materialise the [batch, heads, seq, seq] scores, their scaled copy and the
softmax: three passes over an S² tensor that a fused kernel (flash attention on CPU and
CUDA) never writes to memory. The gain grows with the sequence length, and the simulator says
how much for the device at hand.

Matched in inference forward graphs (aot's ATen spelling of ``torch.matmul`` on 4-D tensors:
expand → clone → _unsafe_view → bmm → view), an optional scale by a positive Python number
(``div`` or ``mul``), an optional additive float mask after the scale or a
``masked_fill(mask, -inf)`` (a causal mask, GPT style), ``_softmax`` over the last dim, an
optional ``clone`` (dropout in eval), the second matmul. Every intermediate must have no
other user. Replaced by ``aten.scaled_dot_product_attention(q, k, v, attn_mask, 0.0, False,
scale=...)`` (a filled mask becomes its negation: SDPA's boolean mask says what takes part).
Values change in the last bits (another summation order): max abs diff ~1e-7 on BERT; and a
query row the mask excludes entirely (filled, or -inf added) gives 0 where eager's softmax gives
NaN: a block whose mask is a constant of the model that does so is left as it is, and where the
mask is only known at the call the pass's notes say so (a causal mask never excludes a whole
row). An add with ``alpha`` (mask weighted) is not SDPA's and is not matched. SDPA takes a float
mask in the queries' dtype: a float32 mask beside bf16 queries is clamped to bf16's range and
cast (its lowest values stay finite, as in eager's float32 softmax); beside float16 queries,
whose range would lose them, the block is not matched. SDPA's output
follows q's layout ([b, s, h, d] in memory on CPU) where the bmm's was contiguous: the values
downstream are re-derived, and where the difference would show (a returned tensor's strides, a
``view`` that needs the old ones, an ``as_strided`` reading any) a clone makes it contiguous again.
Training is left alone: its backward graph holds the unfused gradients.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.fx as fx

from fxdream.pass_api import (
    LAYER,
    PassBase,
    PassContext,
    PassResult,
    choose,
    copy_graph_module,
    fake_value,
    real_tensors,
    register_pass,
)

aten = torch.ops.aten
_FLATTEN = {aten._unsafe_view.default, aten.view.default, aten.reshape.default}
_COPIES = {aten.expand.default, aten.clone.default}
_PLUMBING = _FLATTEN | _COPIES
_SCALES = {aten.div.Tensor: lambda c: 1.0 / c, aten.mul.Tensor: lambda c: c}
TO_COPY = aten._to_copy.default
_WIDE = (torch.float32, torch.float64)
# ops that take any layout and read the elements its strides say (another layout: other elements)
_READS_STRIDES = frozenset({aten.as_strided.default, aten.as_strided_.default, aten.as_strided_scatter.default})


def _float_cast(node: fx.Node) -> bool:
    """A change of float dtype and nothing else: in a bf16 graph a float32 mask makes the scores
    float32 and the bf16 pass casts the probabilities back for the second matmul. The fused call
    computes its softmax with float accumulation itself."""
    return node.target is TO_COPY and set(node.kwargs) == {"dtype"} and node.kwargs["dtype"].is_floating_point


FULLY_MASKED_ROWS = ("a query row whose mask excludes every key with -inf (masked_fill(-inf), or -inf added) "
                     "gives 0 with SDPA where eager softmax gives NaN (a causal mask alone never does)")


@dataclass(frozen=True)
class Attention:
    """One match: the 4-D query, key, value, the mask (or None), the scale, and the nodes."""
    query: fx.Node
    key: fx.Node
    value: fx.Node
    mask: fx.Node | None
    scale: float
    output: fx.Node          # the [b, h, s, dv] result the fused call replaces
    replaced: tuple          # the nodes between the inputs and the output, in graph order
    excludes: bool = False   # mask is masked_fill's (True = left out): SDPA wants its negation


def _shape(node) -> tuple | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _origin(node: fx.Node, batched: tuple) -> tuple[fx.Node, list] | None:
    """The 4-D tensor a bmm operand was flattened from: one view from [b, h, m, n] to
    [b·h, m, n], then only clones and expands to its own shape (a view further up belongs to
    whatever made the tensor, e.g. the block before)."""
    chain = []
    for allowed in (_FLATTEN, _COPIES):
        while node.target in allowed and len(node.users) == 1:
            chain.append(node)
            node = node.args[0]
            if allowed is _FLATTEN:
                break
    shape = _shape(node)
    if shape is None or len(shape) != 4 or (shape[0] * shape[1], *shape[2:]) != batched:
        return None
    if any(n.target is aten.expand.default and tuple(n.args[1]) != shape for n in chain):
        return None  # a broadcast (e.g. grouped heads): not what SDPA computes
    return node, chain


def _key_of(transposed: fx.Node) -> fx.Node | None:
    """k from kᵀ = transpose(k, -1, -2) or permute(k, [0, 1, 3, 2])."""
    if len(transposed.users) != 1:
        return None
    if transposed.target is aten.transpose.int and sorted(d % 4 for d in transposed.args[1:3]) == [2, 3]:
        return transposed.args[0]
    if transposed.target is aten.permute.default and list(transposed.args[1]) == [0, 1, 3, 2]:
        return transposed.args[0]
    return None


def _single_user(node: fx.Node) -> fx.Node | None:
    return next(iter(node.users)) if len(node.users) == 1 else None


def _scores_to_softmax(node: fx.Node):
    """Walk up from the softmax input through at most a scale by a number (÷ or ×), an additive
    float mask after it, and a masked_fill(-inf); (scores, scale, mask, fill mask, nodes)."""
    scale, mask, fill_mask, between = None, None, None, []
    while len(node.users) == 1:
        args = node.args
        if _float_cast(node) and not between and node.kwargs["dtype"] in _WIDE:  # right above the softmax only
            pass  # (a cast to a narrower dtype rounds the scores, which SDPA's float softmax would not)
        elif node.target is aten.add.Tensor and isinstance(args[1], fx.Node) and node.kwargs.get("alpha", 1) == 1 \
                and mask is None and fill_mask is None and scale is None:  # added after the scale: SDPA's order
            mask_val, scores_val = args[1].meta.get("val"), node.meta.get("val")
            if not (isinstance(mask_val, torch.Tensor) and mask_val.dtype == scores_val.dtype):
                return None
            mask = args[1]
        elif node.target is aten.masked_fill.Scalar and args[2] == float("-inf") and fill_mask is None \
                and mask is None:  # -inf: where SDPA's boolean mask excludes, in either order with the scale
            fill_mask = args[1]
        elif node.target in _SCALES and isinstance(args[1], (int, float)) and args[1] > 0 and scale is None:
            scale = _SCALES[node.target](float(args[1]))
        else:
            break
        between.append(node)
        node = args[0]
    return node, 1.0 if scale is None else scale, mask, fill_mask, between


def match(softmax: fx.Node) -> Attention | None:
    """The attention block around one ``_softmax`` node, or None."""
    if softmax.target is not aten._softmax.default or softmax.args[1] not in (-1, 3) or softmax.args[2]:
        return None
    upstream = _scores_to_softmax(softmax.args[0])
    if upstream is None:
        return None
    scores, scale, mask, fill_mask, between = upstream
    replaced = [softmax, *between]
    if scores.target is not aten.view.default or len(scores.users) != 1:
        return None
    bmm = scores.args[0]
    if bmm.target is not aten.bmm.default or len(bmm.users) != 1 or len(_shape(scores) or ()) != 4:
        return None
    q, k_t = _origin(bmm.args[0], _shape(bmm.args[0])), _origin(bmm.args[1], _shape(bmm.args[1]))
    if q is None or k_t is None:
        return None
    key = _key_of(k_t[0])
    if key is None:
        return None
    replaced += [scores, bmm, *q[1], *k_t[1], k_t[0]]
    # downstream: (clone) → expand → view → bmm(·, v) → view [b, h, s, dv]
    node = softmax
    while True:
        user = _single_user(node)
        if user is None:
            return None
        if user.target is aten.bmm.default and user.args[0] is node:
            break
        if user.target not in _PLUMBING and not _float_cast(user):
            return None
        replaced.append(user)
        node = user
    bmm2, output = user, _single_user(user)
    if output is None or output.target is not aten.view.default or len(_shape(output) or ()) != 4:
        return None
    value = _origin(bmm2.args[1], _shape(bmm2.args[1]))
    if value is None:
        return None
    replaced += [bmm2, *value[1]]
    shapes = {n: _shape(n) for n in (q[0], key, value[0], output)}
    (b, h, s, d), (_, _, t, _), (_, _, _, dv) = shapes[q[0]], shapes[key], shapes[value[0]]
    if shapes[key] != (b, h, t, d) or shapes[value[0]] != (b, h, t, dv) or shapes[output] != (b, h, s, dv):
        return None
    if len({_dtype(q[0]), _dtype(key), _dtype(value[0])}) != 1:
        return None  # SDPA takes one dtype for all three
    any_mask = mask if fill_mask is None else fill_mask
    if any_mask is not None and len(_shape(any_mask) or ()) < 2:
        return None  # SDPA takes a mask of (query, key) at least
    if mask is not None and _dtype(mask) != _dtype(q[0]) and _dtype(q[0]) == torch.float16:
        return None  # SDPA takes the mask in float16, whose range loses a float32 mask's lowest values
    order = {n: i for i, n in enumerate(softmax.graph.nodes)}
    return Attention(q[0], key, value[0], mask if fill_mask is None else fill_mask, scale, output,
                     tuple(sorted(set(replaced), key=order.__getitem__)), fill_mask is not None)


_FORM = ("between the matmuls only a scale by a number, then one float mask added (in the queries' dtype, or "
         "float32 beside bfloat16 ones) or masked_fill(-inf), softmax, eval dropout; each intermediate used once; "
         "query, key and value of one dtype")


def softmaxes_between_matmuls(gm: fx.GraphModule, hops: int = 6) -> int:
    """Softmaxes with a bmm a few nodes above and below: attention blocks, matched or not (so a
    pass that fuses none can say it saw them)."""
    def near(start, step) -> bool:  # breadth-first, each node once
        frontier, seen = [start], {start}
        for _ in range(hops):
            frontier = [n for f in frontier for n in step(f) if n not in seen and not seen.add(n)]
            if any(n.target is aten.bmm.default for n in frontier):
                return True
        return False
    above = lambda n: n.all_input_nodes  # noqa: E731
    below = lambda n: list(n.users)  # noqa: E731
    return sum(1 for n in gm.graph.nodes if n.target is aten._softmax.default
               and near(n, above) and near(n, below))


def fuse(gm: fx.GraphModule, sites: list[Attention]) -> None:
    """Replace each matched block by one SDPA call (in place)."""
    graph = gm.graph
    now = {}  # a block's output that an earlier fusion replaced (one block feeding the next)
    for site in sites:
        query, key, value, mask = (now.get(n, n) for n in (site.query, site.key, site.value, site.mask))
        with graph.inserting_before(site.output):
            if site.excludes:
                mask = _layer_call(graph, site, aten.logical_not.default, (mask,))
            mask_dtype, query_dtype = _dtype(mask), _dtype(query)
            if mask_dtype is not None and mask_dtype.is_floating_point and mask_dtype != query_dtype:
                # SDPA takes a float mask in the query's dtype (a float32 mask beside bf16 queries),
                # clamped to its range first: float32's lowest (a Hugging Face padding mask) or -1e9
                # would become -inf there, and a query row it masks whole 0 where eager averages
                mask = _layer_call(graph, site, aten.clamp.default, (mask, torch.finfo(query_dtype).min))
                mask = _layer_call(graph, site, TO_COPY, (mask,), {"dtype": query_dtype})
            fused = _layer_call(graph, site, aten.scaled_dot_product_attention.default,
                                (query, key, value, mask, 0.0, False), {"scale": site.scale})
        site.output.replace_all_uses_with(fused)
        if not _settle_layout(graph, fused):  # SDPA's output follows q's layout, the bmm's is contiguous
            with graph.inserting_after(fused):
                restored = _layer_call(graph, site, aten.clone.default, (fused,),
                                       {"memory_format": torch.contiguous_format})
            fused.replace_all_uses_with(restored, delete_user_cb=lambda user: user is not restored)
            fused = restored
        now[site.output] = fused
        for node in (site.output, *reversed(site.replaced)):
            if not node.users:
                graph.erase_node(node)
    graph.lint()
    gm.recompile()


def _layer_call(graph: fx.Graph, site: Attention, target, args: tuple, kwargs: dict | None = None) -> fx.Node:
    """A node inserted for ``site`` (at the graph's insertion point), with its fake value and
    the block's layer."""
    node = graph.call_function(target, args, kwargs or {})
    node.meta.update({LAYER: site.output.meta.get(LAYER, ""), "val": fake_value(node)})
    return node


def _dtype(node) -> torch.dtype | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value.dtype if isinstance(value, torch.Tensor) else None


def _settle_layout(graph: fx.Graph, fused: fx.Node) -> bool:
    """Re-derive the values downstream of ``fused`` (its layout may differ from the output it
    replaced); False, with nothing changed, where the difference would be seen: a graph output
    with other strides, an op that fails on them (a ``view`` needs the old strides), or a reshape
    of a tensor with a size-1 dim (SDPA's fake kernel strides those unlike the real one)."""
    changed, old_vals = {fused}, {}
    for node in list(graph.nodes)[list(graph.nodes).index(fused) + 1:]:
        if not changed.intersection(node.all_input_nodes):
            continue
        settled = node.op == "call_function" and node.target not in _READS_STRIDES and not (  # else the output
            node.target in _FLATTEN and 1 in getattr(node.args[0].meta.get("val"), "shape", (1,)))  # sees them
        try:  # (a reshape reads a size-1 dim's stride, where SDPA's fake and real kernels differ)
            val = fake_value(node) if settled else None
        except Exception:  # noqa: BLE001 - e.g. view: "size is not compatible with ... stride"
            val = None
        if val is None:
            for earlier, old in old_vals.items():
                earlier.meta["val"] = old
            return False
        if not _same_layout(val, node.meta.get("val")):
            changed.add(node)
            old_vals[node], node.meta["val"] = node.meta.get("val"), val  # later nodes run on it
    return True


def _same_layout(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.stride() == b.stride() and a.storage_offset() == b.storage_offset()
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(map(_same_layout, a, b))
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and a == b


_INFERENCE_ONLY = "inference forward graphs only (a training graph's backward holds the unfused gradients)"


@register_pass
class FuseAttention(PassBase):
    name = "fuse_attention"
    modes, phases = ("inference",), ("fw",)
    why_not = MappingProxyType({"mode": _INFERENCE_ONLY, "phase": _INFERENCE_ONLY})

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        judged = not ctx.forced and ctx.predict_us is not None
        # judged: keep gm unchanged to predict it (predictions are memoized per graph object)
        fused = copy_graph_module(gm) if judged else gm
        sites = [a for a in map(match, list(fused.graph.nodes)) if a is not None]
        unmatched = max(0, softmaxes_between_matmuls(fused) - len(sites))
        if not sites:
            return PassResult(gm, False, f"{unmatched} matmul → softmax → matmul block(s), none in the form SDPA "
                              f"computes ({_FORM}){_in_place_hint(fused)}" if unmatched
                              else "no matmul → softmax → matmul attention block")
        rows_masked = {s: _whole_row_masked(s, ctx) for s in sites}
        sites = [s for s in sites if rows_masked[s] is not True]
        whole_rows = len(rows_masked) - len(sites)
        left_exact = (f"; {whole_rows} more left as they are (a constant mask excludes a whole query row: eager's "
                      f"softmax gives NaN there, SDPA 0)") if whole_rows else ""
        if not sites:
            return PassResult(gm, False, f"{whole_rows} attention block(s) found, none fused: a constant mask "
                                         f"excludes a whole query row (eager's softmax gives NaN there, SDPA 0)")
        layers = tuple(dict.fromkeys(s.output.meta.get(LAYER) or s.output.name for s in sites))
        fuse(fused, sites)
        if judged:
            choice = choose(ctx, gm, {"fused": fused})
            if choice.chosen is None:
                slower = f"{choice.baseline_us:.0f} → {choice.predicted_us['fused']:.0f} µs"
                return PassResult.unchanged(gm, f"{len(sites)} attention block(s) found; fusing them is predicted "
                                            f"slower ({slower})", layers)
        if any(rows_masked[s] is None for s in sites):
            layers += (FULLY_MASKED_ROWS,)
        left = f"; {unmatched} more left as they are (not in the form SDPA computes: {_FORM})" if unmatched else ""
        return PassResult(fused, True, f"{len(sites)} attention block(s) → scaled_dot_product_attention"
                          f"{left}{left_exact}", notes=layers)


_IN_PLACE_SCORES = frozenset({aten.add_.Tensor, aten.div_.Tensor, aten.mul_.Tensor, aten.masked_fill_.Scalar})


def _in_place_hint(gm: fx.GraphModule) -> str:
    """Where the scores' ops are in place (``reinplace`` ran before this pass), say so: the
    form is matched on the out-of-place ops."""
    if any(n.op == "call_function" and n.target in _IN_PLACE_SCORES for n in gm.graph.nodes):
        return "; some ops are in place, as reinplace leaves them: name fuse_attention before reinplace"
    return ""


def _whole_row_masked(site: Attention, ctx: PassContext) -> bool | None:
    """Whether the block's mask leaves a query row no key (eager's softmax: NaN; SDPA: 0); None
    where that is not known before the call (the mask is an input, or computed in the graph)."""
    if site.mask is None:
        return False
    value = ctx.params.get(site.mask.name) if ctx.frozen and site.mask.op == "placeholder" else None
    if not isinstance(value, torch.Tensor):
        return None
    with real_tensors():  # passes run under aot's fake mode
        excluded = value if site.excludes else value == float("-inf")
        return bool(excluded.all(-1).any())
