"""A complete fxdream pass: compute GELU with its tanh approximation.

BERT-style models call the exact GELU (erf). The tanh form is what GPT-2 used and is
cheaper on some hardware; it differs by < 1e-3. Whether it is faster *here* is what the
A/B run answers: ``python -m fxdream ab bert_base --load examples/gelu_tanh.py --pass gelu_tanh``.
"""
import torch

import fxdream
from fxdream.annotate import op_name
from fxdream.pass_api import PassContext, PassResult

aten = torch.ops.aten


@fxdream.register_pass
class GeluTanh:
    name = "gelu_tanh"

    def applies_to(self, ctx: PassContext):
        # the backward graph holds gelu_backward, which we leave exact
        return None if ctx.phase == "fw" else "rewrites forward graphs only"

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        changed = []
        for node in gm.graph.nodes:
            if op_name(node) == "aten.gelu" and node.kwargs.get("approximate", "none") == "none":
                if ctx.training:
                    continue  # the saved-for-backward value must stay the one autograd traced
                node.kwargs = {**node.kwargs, "approximate": "tanh"}
                changed.append(node.meta.get("layer", node.name))
        if not changed:
            return PassResult(gm, False, "no exact GELU in inference forward graphs")
        return PassResult(gm, True, f"{len(changed)} GELU(s) now use the tanh form",
                          notes=tuple(changed))
