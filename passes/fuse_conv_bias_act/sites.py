"""The pattern matcher of fuse_conv_bias_act: where a convolution and what follows it can be fused.

Not a pass (passes/__init__ registers the passes by name); apart so that the pass file holds
the rewrite and the choice between variants."""
from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from fxdream.ops import fused_conv as ops
from fxdream.pass_api import LAYER, Note, PassContext, frozen_value, value_of

aten = torch.ops.aten
CONV, RELU, ADD = aten.convolution.default, aten.relu.default, aten.add.Tensor
BN = aten._native_batch_norm_legit_no_training.default


@dataclass
class Site:
    """One match; ``last`` is the node whose value the fused op replaces."""
    conv: fx.Node
    parts: list = field(default_factory=list)
    bn: fx.Node | None = None
    bn_out: fx.Node | None = None
    add: fx.Node | None = None
    other_index: int = 1
    act: fx.Node | None = None   # the activation fused in: relu, or in CPU inference one of INFERENCE_ACTS

    @property
    def last(self) -> fx.Node:
        return self.act or self.add or self.bn_out or self.conv

    @property
    def kind(self) -> str:
        return "+".join(self.parts)

    @property
    def layer(self) -> str:
        return self.conv.meta.get(LAYER) or self.conv.name



def _users(node: fx.Node) -> str:
    return ", ".join(u.name for u in node.users)


def _described(value) -> str:
    if isinstance(value, torch.Tensor):
        return f"{str(value.dtype).removeprefix('torch.')} {tuple(value.shape)}"
    return f"the number {value}" if isinstance(value, (int, float)) else "not a tensor"


def _conv_problem(conv: fx.Node, ctx: PassContext) -> str | None:
    """Why this convolution cannot be fused, or None."""
    if len(conv.args) != 9 or conv.kwargs:
        return "unexpected convolution signature"
    x, w = value_of(conv.args[0]), value_of(conv.args[1])
    if conv.args[6]:
        return "transposed convolution"
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return "unknown input or weight"
    # a meta tensor (a capture for a device that is not here) runs on the device planned for
    device = ctx.device if x.device.type == "meta" else x.device.type
    if device == "cuda":
        if x.dim() != 4:
            return f"a {x.dim() - 2}-d convolution on CUDA (the cuDNN fused kernels this pass uses are 2-d)"
        return None if x.dtype in (torch.float32, torch.float16, torch.bfloat16) else f"dtype {x.dtype}"
    if device == "cpu" and (x.dtype == torch.float32 or x.dtype == w.dtype == torch.bfloat16
                            and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        return None if x.dim() in (3, 4, 5) else f"a {x.dim() - 2}-d convolution (oneDNN's fused conv is 1-d to 3-d)"
    return f"{device} {x.dtype}: no fused kernel"


def _sole_user(node: fx.Node, target) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 and users[0].op == "call_function" and users[0].target is target else None


def _foldable_bn(conv: fx.Node, ctx: PassContext, notes: list) -> fx.Node | None:
    bn = _sole_user(conv, BN)
    if bn is None or bn.args[0] is not conv:
        if any(u.op == "call_function" and u.target is BN for u in conv.users):
            notes.append(f"{conv.meta.get(LAYER, conv.name)}: batch norm not folded: the conv output is "
                         f"also used by {_users(conv)}")
        return None
    tensors = [conv.args[1], conv.args[2], *bn.args[1:5]]
    if any(t is not None and frozen_value(t, ctx) is None for t in tensors):
        notes.append(f"{conv.meta.get(LAYER, conv.name)}: batch norm not folded: its weights are not "
                     "known constants")
        return None
    outs = list(bn.users)
    if not all(u.target is operator.getitem for u in outs) or [u.args[1] for u in outs] != [0]:
        notes.append(f"{conv.meta.get(LAYER, conv.name)}: batch norm not folded: its statistics are used")
        return None
    return bn


# oneDNN's unary post-ops beyond ReLU (MobileNet's hardswish, EfficientNet's SiLU): CPU inference
# only (the trainable ops' backward is ReLU's); fused, conv + activation can run several times
# faster than the conv, then the activation; hardtanh is ReLU6 (MobileNetV2), with its bounds.
# The ops and names are fxdream.ops.UNARY's, the fused op's post-ops.
INFERENCE_ACTS = {op: name for name, op in ops.UNARY.items() if op is not RELU}


def onednn_act(node: fx.Node, acts: dict) -> str:
    """The fused op's ``act`` for an activation node ("hardtanh:0.0,6.0" carries the bounds)."""
    name = acts[node.target]
    if name == "hardtanh":
        low = node.args[1] if len(node.args) > 1 else node.kwargs.get("min_val", -1.0)
        high = node.args[2] if len(node.args) > 2 else node.kwargs.get("max_val", 1.0)
        return f"hardtanh:{float(low)},{float(high)}"
    return name


def fusable_acts(ctx: PassContext) -> dict:
    """Activation op → oneDNN's name for it, for a conv not followed by an add."""
    acts = {RELU: "relu"}
    if ctx.frozen and ctx.device == "cpu":
        acts.update(INFERENCE_ACTS)
    return acts


SKIPPED = "skipped"  # the kind of a note on a convolution left alone (the reason counts them by their detail)


def find_sites(graph: fx.Graph, ctx: PassContext) -> tuple[list[Site], list[str]]:
    """Walk from every convolution through [bn] → [add → relu] or [act]; notes say what was left."""
    sites, notes, claimed = [], [], set()
    for conv in graph.nodes:
        if conv.op != "call_function" or conv.target is not CONV:
            continue
        problem = _conv_problem(conv, ctx)
        if problem is not None:
            notes.append(Note(conv.meta.get(LAYER, conv.name), problem, SKIPPED))
            continue
        site = Site(conv, ["conv"] + (["bias"] if conv.args[2] is not None else []))
        cur = conv
        if ctx.frozen and (bn := _foldable_bn(conv, ctx, notes)) is not None:
            site.bn, site.bn_out, cur = bn, next(iter(bn.users)), next(iter(bn.users))
            site.parts.append("bn")
        add = _sole_user(cur, ADD)
        if (add is not None and add not in claimed and not add.kwargs and len(add.args) == 2
                and add.args[0] is not add.args[1]):
            index = 1 if add.args[0] is cur else 0
            other, relu = value_of(add.args[index]), _sole_user(add, RELU)
            if (isinstance(add.args[index], fx.Node) and isinstance(other, torch.Tensor)
                    and other.shape == value_of(cur).shape and other.dtype == value_of(cur).dtype and relu is not None):
                site.add, site.other_index, site.act, cur = add, index, relu, relu
                site.parts += ["add", "relu"]
            elif relu is None and any(u.target is RELU for u in add.users):
                notes.append(f"{site.layer}: add+relu not fused: the sum is also used by {_users(add)}")
            elif relu is not None:
                notes.append(f"{site.layer}: add+relu not fused: the other addend is not a tensor of the "
                             f"convolution's shape and dtype ({_described(other)})")
        if site.act is None:
            acts = fusable_acts(ctx)
            site.act = next((u for u in [_sole_user(cur, t) for t in acts] if u is not None), None)
            if site.act is not None and any(isinstance(a, fx.Node) for a in site.act.args[1:]):
                site.act = None  # a hardtanh whose bounds are computed: oneDNN needs numbers
            if site.act is not None:
                site.parts.append(site.act.target.overloadpacket.__name__)  # relu, silu, hardswish...
            elif (blocked := next((u for u in cur.users if u.op == "call_function" and u.target in acts),
                                  None)) is not None:
                notes.append(f"{site.layer}: {blocked.target.overloadpacket.__name__} not fused: {cur.name} "
                             f"is also used by {_users(cur)}")
        if ctx.frozen or site.act is not None:
            sites.append(site)
            claimed.update((site.add, site.act))
        else:
            notes.append(Note(site.layer, _why_nothing_follows(cur), SKIPPED))
    return sites, notes


def _why_nothing_follows(out: fx.Node) -> str:
    """Why a conv (not frozen: nothing folds) has nothing to fuse after it."""
    if any(u.op == "call_function" and "batch_norm" in str(getattr(u.target, "__name__", u.target))
           for u in out.users):
        return "followed by batch norm in training, whose batch statistics leave nothing to fold"
    return "not followed by relu or add+relu"
