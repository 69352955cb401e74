"""A complete fxdream pass: compute GELU with its tanh approximation.

BERT-style models call the exact GELU (erf). The tanh form is what GPT-2 used and is
cheaper on some hardware; it differs by < 1e-3. Whether it is faster *here* is what the
A/B run answers: ``python -m fxdream ab bert_base --load examples/gelu_tanh.py --pass gelu_tanh``.
"""
import torch

from fxdream.pass_api import LAYER, PassBase, PassContext, PassResult, op_name, register_pass


@register_pass
class GeluTanh(PassBase):
    name = "gelu_tanh"
    phases = ("fw",)  # the backward graph holds gelu_backward, which we leave exact
    why_not = {"phase": "rewrites forward graphs only"}

    def __call__(self, gm: torch.fx.GraphModule, ctx: PassContext) -> PassResult:
        changed = []
        for node in gm.graph.nodes:
            if op_name(node) == "aten.gelu" and node.kwargs.get("approximate", "none") == "none":
                if ctx.training:
                    continue  # the saved-for-backward value must stay the one autograd traced
                node.kwargs = {**node.kwargs, "approximate": "tanh"}
                changed.append(node.meta.get(LAYER, node.name))
        if not changed:
            return PassResult.unchanged(gm, "no exact GELU in inference forward graphs")
        return PassResult.changed(gm, f"{len(changed)} GELU(s) now use the tanh form", changed)
