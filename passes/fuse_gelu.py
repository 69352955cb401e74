"""fuse_gelu: a GELU written out in elementwise ops as one ``aten.gelu``.

GPT-2 and its kin (Hugging Face's ``NewGELUActivation``, "gelu_new") write the tanh
approximation out, 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))), and older code the exact form,
0.5·x·(1 + erf(x/√2)). Captured, that is 8 (tanh) or 5 (erf) elementwise kernels, each reading
and writing the whole activation; ``aten.gelu(x, approximate="tanh" / "none")`` is one kernel
computing the same function (values equal to rounding: a few ulp), and ``prepack_linear``
then applies it as the post-op of the linear layer before it.

Matched by value, not by the order the model wrote it: the product (``mul``) and sum (``add``)
trees are flattened into their factors and terms, so ``0.5 * x * (1 + t)``, ``x * (t + 1) * 0.5``
and ``x * 0.5 * (...)`` all match; ``x³`` is ``pow(x, 3)`` or ``x * x * x``; ``x / √2`` is a
``div`` or a ``mul`` by 1/√2; constants compare within 1e-6 relative. Every intermediate must
have no reader outside the formula. Inference forward graphs only: in training aot_autograd
derived the backward from the written-out ops and saved their intermediates.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.fx as fx

from fxdream.pass_api import PassBase, PassContext, PassResult, copy_graph_module, kept_if_faster, register_pass

aten = torch.ops.aten
MUL = (aten.mul.Tensor, aten.mul.Scalar)
ADD = (aten.add.Tensor, aten.add.Scalar)
POW = (aten.pow.Tensor_Scalar,)
SQRT_2_OVER_PI, CUBIC, HALF = math.sqrt(2 / math.pi), 0.044715, 0.5
INV_SQRT_2 = 1 / math.sqrt(2)


@dataclass(frozen=True)
class Gelu:
    """One written-out GELU: its input, the node whose value it is, its form, and every node
    of the formula (all dead once ``output`` reads from one ``aten.gelu``)."""
    x: fx.Node
    output: fx.Node
    approximate: str           # "tanh" or "none" (erf)
    formula: tuple[fx.Node, ...]


def _is(node, targets) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in targets and not node.kwargs


def _number(value, expected: float) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and \
        math.isclose(value, expected, rel_tol=1e-6)


def _flatten(node: fx.Node, targets, formula: list) -> list:
    """The leaves of the ``targets`` tree (mul: factors, add: terms) rooted at ``node``; an inner
    node joins ``formula`` and is only descended into when the tree is its one reader."""
    formula.append(node)
    leaves = []
    for arg in node.args:
        if _is(arg, targets) and len(arg.users) == 1:
            leaves += _flatten(arg, targets, formula)
        else:
            leaves.append(arg)
    return leaves


def _take(leaves: list, test) -> object | None:
    """Remove and return the first leaf passing ``test``; None when none does."""
    for i, leaf in enumerate(leaves):
        if test(leaf):
            return leaves.pop(i)
    return None


def _cube_of(leaves: list, x: fx.Node, formula: list) -> bool:
    """``leaves`` (a product's, less its constant) are x³: ``pow(x, 3)`` or x, x, x."""
    if len(leaves) == 3 and all(leaf is x for leaf in leaves):
        return True
    if len(leaves) == 1 and _is(leaves[0], POW) and leaves[0].args[0] is x and _number(leaves[0].args[1], 3):
        formula.append(leaves[0])
        return True
    return False


def _tanh_inner(inner: fx.Node, x: fx.Node, formula: list) -> bool:
    """``inner`` is √(2/π)·(x + 0.044715·x³)."""
    if not _is(inner, MUL):
        return False
    factors = _flatten(inner, MUL, formula)
    if _take(factors, lambda v: _number(v, SQRT_2_OVER_PI)) is None or len(factors) != 1 \
            or not _is(factors[0], ADD) or len(factors[0].users) != 1:
        return False
    terms = _flatten(factors[0], ADD, formula)
    if _take(terms, lambda v: v is x) is None or len(terms) != 1 or not _is(terms[0], MUL) \
            or len(terms[0].users) != 1:
        return False
    cubic = _flatten(terms[0], MUL, formula)
    return _take(cubic, lambda v: _number(v, CUBIC)) is not None and _cube_of(cubic, x, formula)


def _erf_inner(inner: fx.Node, x: fx.Node, formula: list) -> bool:
    """``inner`` is x/√2 (a division by √2 or a product with 1/√2)."""
    if _is(inner, (aten.div.Tensor, aten.div.Scalar)):
        formula.append(inner)
        return inner.args[0] is x and _number(inner.args[1], math.sqrt(2))
    if not _is(inner, MUL):
        return False
    factors = _flatten(inner, MUL, formula)
    return _take(factors, lambda v: _number(v, INV_SQRT_2)) is not None and factors == [x]


def _one_plus(node, formula: list) -> tuple[fx.Node, str] | None:
    """(the tanh/erf node, its form) when ``node`` is 1 + tanh(...) or 1 + erf(...)."""
    if not _is(node, ADD) or len(node.users) != 1:
        return None
    terms = _flatten(node, ADD, formula)
    if _take(terms, lambda v: _number(v, 1.0)) is None or len(terms) != 1 or len(terms[0].users) != 1:
        return None
    if _is(terms[0], (aten.tanh.default,)):
        return terms[0], "tanh"
    if _is(terms[0], (aten.erf.default,)):
        return terms[0], "none"
    return None


def match(output: fx.Node) -> Gelu | None:
    """The GELU whose value ``output`` (a ``mul``) is, or None."""
    if not _is(output, MUL):
        return None
    formula: list = []
    factors = _flatten(output, MUL, formula)
    if _take(factors, lambda v: _number(v, HALF)) is None or len(factors) != 2:
        return None
    for s, x in (factors, factors[::-1]):
        inner_formula = list(formula)
        plus = _one_plus(s, inner_formula) if isinstance(x, fx.Node) else None
        if plus is None:
            continue
        function, form = plus
        inner_formula.append(function)
        inner = function.args[0]
        ok = _tanh_inner(inner, x, inner_formula) if form == "tanh" else _erf_inner(inner, x, inner_formula)
        if ok and _closed(inner_formula, output, x):
            return Gelu(x, output, form, tuple(inner_formula))
    return None


def _closed(formula: list, output: fx.Node, x: fx.Node) -> bool:
    """No node of the formula but ``output`` is read outside it, and the result has x's shape
    and dtype (no broadcast, no promotion)."""
    inside = set(formula)
    if any(user not in inside for node in formula if node is not output for user in node.users):
        return False
    value, result = x.meta.get("val"), output.meta.get("val")
    return isinstance(value, torch.Tensor) and isinstance(result, torch.Tensor) and value.is_floating_point() \
        and value.shape == result.shape and value.dtype == result.dtype


def find_gelus(graph: fx.Graph) -> list[Gelu]:
    found, used = [], set()
    for node in graph.nodes:
        gelu = match(node)
        if gelu is not None and not used & set(gelu.formula):
            found.append(gelu)
            used.update(gelu.formula)
    return found


def _rewrite(gm: fx.GraphModule, gelus: list[Gelu]) -> None:
    graph = gm.graph
    for gelu in gelus:
        with graph.inserting_before(gelu.output):
            fused = graph.call_function(aten.gelu.default, (gelu.x,), {"approximate": gelu.approximate})
        fused.meta.update(gelu.output.meta)
        gelu.output.replace_all_uses_with(fused)
        for node in gelu.formula:  # collected from the output down: each node before what it reads
            if not node.users:
                graph.erase_node(node)
    graph.lint()
    gm.recompile()


_FORWARD_ONLY = "inference forward graphs only (in training the backward reads the formula's intermediates)"


@register_pass
class FuseGelu(PassBase):
    name = "fuse_gelu"
    modes, phases = ("inference",), ("fw",)
    why_not = MappingProxyType({"mode": _FORWARD_ONLY, "phase": _FORWARD_ONLY})

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        gelus = find_gelus(gm.graph)
        if not gelus:
            return PassResult(gm, False, "no GELU written out in elementwise ops (tanh or erf form)")
        original = copy_graph_module(gm) if ctx.predict_us is not None else None
        forms = sorted({"tanh" if g.approximate == "tanh" else "erf" for g in gelus})
        ops = sum(len(g.formula) for g in gelus)
        what = f"{len(gelus)} GELU(s) written out in {ops} elementwise ops ({', '.join(forms)} form) now one op each"
        _rewrite(gm, gelus)
        return kept_if_faster(ctx, original, gm, what)
