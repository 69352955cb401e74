"""bf16: CPU inference with convolutions and matrix products in bfloat16 (``optimize(...,
precision="bf16")``), as the inference engines' reduced-precision modes and CPU autocast do.

It changes numerics, so ``passes="auto"`` never picks it on its own (``changes_numerics``): the
user asks for it, and the report gives the measured deviation from float32 on the example inputs.

The rule, CPU autocast's: the ops oneDNN runs fast in bf16 (convolution, the matrix products,
scaled-dot-product attention; PReLU, as autocast casts it) take bf16 inputs (float32 inputs are
cast where they meet such an op), and, as the inference engines do and autocast does not, so do
embedding lookups, whose bf16 tables keep a transformer's residual stream in bf16 (no cast before
each linear layer).
Recurrent layers take float32 (their weights stay float32; oneDNN's RNN primitive takes no bf16
input beside them). Every other op runs in the dtype its inputs bring: a ReLU, a pooling, a
residual add after a bf16 conv stay bf16; softmax and layer norm take bf16 and accumulate in
float32 inside their kernels, as under autocast; a batch norm keeps its float32 statistics;
type promotion makes a bf16 value added to a float32 one float32.

Float32 parameters a bf16 op reads become bf16 constants once, at build time (weights are frozen
in inference), so no call pays their casts; graph outputs are cast back to their float32 dtype.
On a CPU without native bf16 (AVX-512 BF16 or AMX) oneDNN would emulate it, slower than float32:
the pass declines there, saying so.
"""
from __future__ import annotations

import operator
from collections import Counter

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from fxdream.ir.nodes import is_view
from fxdream.pass_api import (
    LAYER,
    PassBase,
    PassContext,
    PassResult,
    fake_value,
    frozen_value,
    real_tensors,
    register_pass,
)
from fxdream.sim.cost import devices as device_specs

aten = torch.ops.aten
BF16, FP32 = torch.bfloat16, torch.float32
TO_COPY = aten._to_copy.default
IN_BF16 = frozenset({
    aten.convolution.default, aten.addmm.default, aten.mm.default, aten.bmm.default, aten.baddbmm.default,
    aten.linear.default, aten.matmul.default, aten.scaled_dot_product_attention.default,
    aten.embedding.default, aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._prelu_kernel.default,  # autocast's too; its kernel takes no float32 weight beside a bf16 input
})
PRELU = aten._prelu_kernel.default
EMBEDDING = aten.embedding.default
# Recurrent layers keep float32: their weights stay float32 and oneDNN's RNN primitive takes no
# bf16 input beside them; a bf16 value reaching one is cast up.
IN_FP32 = frozenset(op for op in (
    aten.lstm.input, aten.gru.input, aten.rnn_tanh.input, aten.rnn_relu.input, aten.lstm_cell.default,
    aten.gru_cell.default, aten.rnn_tanh_cell.default, aten.rnn_relu_cell.default, aten.mkldnn_rnn_layer.default,
    *(getattr(getattr(torch.ops.fxdream, name, None), "default", None)
      for name in ("rnn_inference", "lstm_inference", "rnn_cell_inference")),
) if op is not None)


def _float_value(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) and value.dtype in (BF16, FP32) else None


def fake_mode_of(gm: fx.GraphModule):
    """The fake mode the graph's values were made in (None where it carries none)."""
    values = (n.meta.get("val") for n in gm.graph.nodes)
    return next((v.fake_mode for v in values if hasattr(v, "fake_mode")), None)


class _Rewriter:
    """Walks the graph once in order: casts the inputs an op's rule asks for, re-derives each
    op's fake value from its (possibly cast) inputs, and casts the outputs back."""

    def __init__(self, gm: fx.GraphModule, ctx: PassContext):
        self.gm, self.graph, self.ctx = gm, gm.graph, ctx
        self.fake_mode = fake_mode_of(gm)
        self.casts: dict[tuple[str, torch.dtype], fx.Node] = {}
        self.constants = 0
        self.cast_ops = 0

    def run(self) -> None:
        original = {n.name: n.meta.get("val") for n in self.graph.nodes}
        for node in list(self.graph.nodes):
            if node.op == "call_function":
                self._retype(node)
            elif node.op == "output":
                node.args = tree_map(lambda a: self._restore(a, original.get(a.name), node)
                                     if isinstance(a, fx.Node) else a, node.args)

    def _retype(self, node: fx.Node) -> None:
        wanted = BF16 if node.target in IN_BF16 else FP32 if node.target in IN_FP32 else None
        if wanted is not None:
            node.args, node.kwargs = tree_map(lambda a: self._as(a, wanted, node) if isinstance(a, fx.Node) else a,
                                              (node.args, node.kwargs))
        values, _ = tree_flatten([a.meta.get("val") for a in node.all_input_nodes])
        if not any(isinstance(v, torch.Tensor) and v.dtype == BF16 for v in values):
            return  # nothing of bf16 reaches it: its value is as captured
        if node.target is operator.getitem:  # an element of a multi-output op's value
            value = node.args[0].meta["val"][node.args[1]]
        else:
            value = fake_value(node)
        if value is not None:
            node.meta["val"] = value

    def _as(self, source: fx.Node, dtype: torch.dtype, user: fx.Node) -> fx.Node:
        """``source`` in ``dtype``: itself, a bf16 constant made once (a frozen float32
        parameter), or a cast made once per source and dtype."""
        value = _float_value(source)
        if value is None or value.dtype == dtype:
            return source
        key = (source.name, dtype)
        if key not in self.casts:
            param = frozen_value(source, self.ctx)
            if param is not None:
                self.casts[key] = self._constant(source, param, dtype)
            elif self._viewed_param(source):  # t(w): the view of the cast constant, not a cast per call
                self.casts[key] = self._view_of(source, self._as(source.args[0], dtype, user), user)
            else:
                self.casts[key] = self._cast(source, dtype, user)
        return self.casts[key]

    def _viewed_param(self, node: fx.Node) -> bool:
        while node.op == "call_function" and is_view(node) and node.args and isinstance(node.args[0], fx.Node):
            node = node.args[0]
        return frozen_value(node, self.ctx) is not None

    def _view_of(self, view: fx.Node, base: fx.Node, user: fx.Node) -> fx.Node:
        with self.graph.inserting_before(user):
            node = self.graph.call_function(view.target, (base, *view.args[1:]), dict(view.kwargs))
        node.meta.update({"val": fake_value(node), LAYER: view.meta.get(LAYER, "")})
        return node

    def _constant(self, source: fx.Node, param: torch.Tensor, dtype: torch.dtype) -> fx.Node:
        name = f"_fxdream_{source.name}_{str(dtype).removeprefix('torch.')}"
        while hasattr(self.gm, name):
            name += "_"
        with real_tensors(), torch.no_grad():  # a capture may run passes inside its fake mode
            self.gm.register_buffer(name, param.detach().to(dtype, copy=True), persistent=False)
        first = next(n for n in self.graph.nodes if n.op != "placeholder")
        with self.graph.inserting_before(first):
            node = self.graph.get_attr(name)
        # static: a constant's sizes are no symbols of the shape environment (dynamo's guards for
        # a recompilation would find symbols without a source, and fail)
        fake = self.fake_mode.from_tensor(getattr(self.gm, name), static_shapes=True)
        node.meta.update({"val": fake, LAYER: source.meta.get(LAYER, "")})
        self.constants += 1
        return node

    def _cast(self, source: fx.Node, dtype: torch.dtype, user: fx.Node) -> fx.Node:
        with self.graph.inserting_before(user):
            cast = self.graph.call_function(TO_COPY, (source,), {"dtype": dtype})
        cast.meta.update({"val": fake_value(cast), LAYER: user.meta.get(LAYER, "")})
        self.cast_ops += 1
        return cast

    def _restore(self, node: fx.Node, original, output: fx.Node) -> fx.Node:
        value = _float_value(node)
        if value is None or not isinstance(original, torch.Tensor) or value.dtype == original.dtype:
            return node
        return self._as(node, original.dtype, output)


@register_pass
class Bf16Inference(PassBase):
    name = "bf16"
    devices = ("cpu",)
    modes = ("inference",)
    phases = ("fw",)
    changes_numerics = True
    order = -10  # first: the rewrites after it (fused convs, packed linears) see the bf16 graph
    why_not = {"device": "bf16 mode is for CPU inference; on {device} use torch.autocast",
               "mode": "bf16 mode is for inference: training in bf16 needs float32 master weights (torch.autocast)"}

    def requires(self, ctx: PassContext) -> str | None:
        if not device_specs.native_bf16():
            return ("this CPU has no native bf16 (AVX-512 BF16 or AMX): oneDNN would emulate it, slower than "
                    "float32")
        return None

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        leaves, _ = tree_flatten([n.meta.get("val") for n in gm.graph.nodes if n.op == "call_function"
                                  and n.target in IN_BF16])
        if not any(isinstance(v, torch.Tensor) and v.dtype == FP32 for v in leaves):
            return PassResult.unchanged(gm, "no float32 convolution or matrix product to run in bf16")
        if fake_mode_of(gm) is None:
            return PassResult.unchanged(gm, "the graph carries no fake values to re-derive dtypes from")
        rewriter = _Rewriter(gm, ctx)
        rewriter.run()
        gm.graph.eliminate_dead_code()
        gm.recompile()
        ran = Counter(n.target is EMBEDDING for n in gm.graph.nodes
                      if n.op == "call_function" and n.target in IN_BF16 and n.target is not PRELU)
        lookups = f", {ran[True]} embedding lookups" if ran[True] else ""
        return PassResult.changed(gm, f"{ran[False]} convolutions and matrix products{lookups} in bf16; "
                                      f"{rewriter.constants} weights made bf16 once, "
                                      f"{rewriter.cast_ops} casts per call")
