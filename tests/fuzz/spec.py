"""The data of a fuzzed net (``NetSpec``, its layers ``L``), its shapes and its description.

Plain data whose ``repr`` is valid Python; ``nets.py`` draws specs, ``modules.py`` builds them."""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn

from .attention import describe as describe_attention


class L:
    """One layer of a spec: a kind and keyword parameters. ``repr`` is valid Python."""

    __slots__ = ("kind", "kw")

    def __init__(self, kind: str, **kw):
        object.__setattr__(self, "kind", kind)
        object.__setattr__(self, "kw", dict(kw))

    def __getattr__(self, name):
        try:
            return self.kw[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        raise AttributeError("L is immutable")

    def __eq__(self, other):
        return isinstance(other, L) and (self.kind, self.kw) == (other.kind, other.kw)

    def __hash__(self):
        return hash((self.kind, tuple(sorted(self.kw.items()))))

    def __repr__(self):
        return f"L({self.kind!r}" + "".join(f", {k}={v!r}" for k, v in self.kw.items()) + ")"


@dataclasses.dataclass(frozen=True)
class NetSpec:
    kind: str              # "conv" (input (C, H, W)) | "mlp" (input (F,) or (T, F))
    batch: int
    in_shape: tuple
    layers: tuple          # of L
    head: L | None
    seed: int

    def build(self) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
        """The model (in train mode, as nn.Modules start) and its example inputs."""
        from .modules import Net, randomize_norm_layers  # modules builds from this module's specs
        torch.manual_seed(self.seed)
        model = Net(self)
        randomize_norm_layers(model, self.seed)
        generator = torch.Generator().manual_seed(self.seed + 1)
        x = torch.randn(self.batch, *self.in_shape, generator=generator)
        return model, (x,)

    def shapes(self) -> list[tuple]:
        """Per-sample shape after each layer (head excluded)."""
        shape, out = self.in_shape, []
        for layer in self.layers:
            shape = out_shape(layer, shape)
            out.append(shape)
        return out

    def has_graph_break(self) -> bool:
        """A break layer, or BatchNorm(momentum=None): in training it calls float() on a tensor."""
        return any(_breaks(layer) for layer in self.layers)

    def describe(self) -> str:
        lines = [f"{self.kind} net: batch={self.batch}, input={self.in_shape}, seed={self.seed}"]
        for i, (layer, shape) in enumerate(zip(self.layers, self.shapes())):
            lines.append(f"  {i:>2}: {describe_layer(layer):<72} -> {shape}")
        if self.head is not None:
            lines.append(f"  head: {describe_layer(self.head)}")
        return "\n".join(lines)


def _breaks(layer: L) -> bool:
    if layer.kind == "break" or (layer.kind == "bn" and layer.momentum is None):
        return True
    return any(_breaks(sub) for sub in layer.kw.get("inner", ()) + layer.kw.get("branch", ()))


# --------------------------------------------------------------------------------------------
# shapes
# --------------------------------------------------------------------------------------------

def conv_len(n, k, s, p, d):
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def pool_len(n, k, s, p, ceil_mode):
    if not ceil_mode:
        return (n + 2 * p - k) // s + 1
    out = math.ceil((n + 2 * p - k) / s) + 1
    if (out - 1) * s >= n + p:
        out -= 1
    return out


def out_shape(layer: L, shape: tuple) -> tuple:
    kind = layer.kind
    if kind == "conv":
        _, h, w = shape
        return (layer.cout, conv_len(h, layer.k, layer.s, layer.p, layer.d),
                conv_len(w, layer.k, layer.s, layer.p, layer.d))
    if kind == "pool":
        c, h, w = shape
        if layer.op == "adaptive":
            return (c, layer.size, layer.size)
        return (c, pool_len(h, layer.k, layer.s, layer.p, layer.ceil),
                pool_len(w, layer.k, layer.s, layer.p, layer.ceil))
    if kind == "linear":
        return shape[:-1] + (layer.out,)
    if kind in ("res", "fork", "shared"):
        inner = shape
        for sub in (layer.inner if kind == "res" else ()):
            inner = out_shape(sub, inner)
        if kind == "fork":
            inner = out_shape(layer.conv, shape)
            if layer.combine == "cat":
                inner = (2 * inner[0],) + inner[1:]
        return inner
    return shape  # bn, ln, act, dropout, inplace, break



# --------------------------------------------------------------------------------------------
# describe
# --------------------------------------------------------------------------------------------

def describe_layer(layer: L) -> str:
    k = layer.kind
    if k == "conv":
        extra = "".join([f", groups={layer.groups}" if layer.groups > 1 else "",
                         f", dilation={layer.d}" if layer.d > 1 else "", "" if layer.bias else ", bias=False"])
        return f"Conv2d({layer.cin}→{layer.cout}, k={layer.k}, s={layer.s}, p={layer.p}{extra})"
    if k == "linear":
        return f"Linear({layer.fin}→{layer.out}{'' if layer.bias else ', bias=False'})"
    if k == "bn":
        return (f"BatchNorm{'2d' if layer.dims == 3 else '1d'}({layer.c}"
                f"{'' if layer.affine else ', affine=False'}"
                f"{'' if layer.momentum is not None else ', momentum=None'})")
    if k == "ln":
        return f"LayerNorm({layer.f}{'' if layer.affine else ', elementwise_affine=False'})"
    if k == "act":
        return {"relu": "ReLU()", "relu_inplace": "ReLU(inplace=True)", "relu_": "torch.relu_",
                "gelu": "GELU()", "gelu_tanh": "GELU(approximate='tanh')", "silu": "SiLU()", "relu6": "ReLU6()",
                "relu6_inplace": "ReLU6(inplace=True)", "hardtanh": "Hardtanh(-0.5, 0.5)",
                "gelu_new": "GELU written out (tanh form)", "gelu_erf": "GELU written out (erf form)"}[layer.fn]
    if k == "res":
        inner = " → ".join(describe_layer(s) for s in layer.inner)
        short = "x" if layer.proj is None else describe_layer(layer.proj) + (" → BN" if layer.proj_bn else "")
        op = {"+": "+", "add_": ".add_", "+=": "+="}[layer.add]
        order = f"shortcut {op} inner" if layer.shortcut_first and layer.add == "+" else f"inner {op} shortcut"
        post = f" → {describe_layer(L('act', fn=layer.post))}" if layer.post else ""
        return f"Residual[{order}; inner: {inner}; shortcut: {short}]{post}"
    if k == "fork":
        branch = " → ".join(describe_layer(s) for s in layer.branch)
        return f"Fork[y = {describe_layer(layer.conv)}; {layer.combine}(({branch})(y), y)]"
    if k == "shared":
        bn = "BN_i" if layer.bn else ""
        act = describe_layer(L("act", fn=layer.act)) if layer.act else ""
        return f"Shared[same {describe_layer(layer.conv)} twice, {' → '.join(filter(None, ['conv', bn, act, 'conv', bn]))}]"
    if k == "pool":
        if layer.op == "adaptive":
            return f"AdaptiveAvgPool2d({layer.size})"
        extra = ", ceil_mode=True" if layer.ceil else ""
        if layer.op == "avg" and not layer.count_include_pad:
            extra += ", count_include_pad=False"
        return f"{'MaxPool2d' if layer.op == 'max' else 'AvgPool2d'}(k={layer.k}, s={layer.s}, p={layer.p}{extra})"
    if k == "dropout":
        name = {"module": "Dropout", "2d": "Dropout2d", "functional": "F.dropout"}[layer.variant]
        return f"{name}(p={layer.p}{', inplace=True' if layer.inplace else ''})"
    if k == "inplace":
        return {"add_param": f"x.add_(param{layer.shape})", "add_scalar": "x.add_(0.25)",
                "mul_scalar": "x.mul_(0.5)", "clamp_": "x.clamp_(-2, 2)"}[layer.op]
    if k == "break":
        return {"item": "graph break: x / (1 + x.abs().max().item())", "print": "graph break: print()",
                "graph_break": "graph break: torch._dynamo.graph_break()"}[layer.how]
    if k == "attn":
        return describe_attention(layer)
    if k == "head":
        pool = {"mean": "mean(2,3) → ", "amax": "amax(2,3) → ", "flatten": "flatten → ", "none": ""}[layer.pool]
        return f"{pool}Linear(→{layer.out}{'' if layer.bias else ', bias=False'})"
    return repr(layer)

