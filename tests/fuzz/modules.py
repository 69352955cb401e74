"""nn.Modules of fuzzed nets: ``Net(spec)`` builds the layers a ``NetSpec`` lists."""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from .attention import Attention
from .spec import L, NetSpec, out_shape

# --------------------------------------------------------------------------------------------
# the builder
# --------------------------------------------------------------------------------------------

class NewGelu(nn.Module):
    """GELU's tanh approximation written out, as GPT-2's code has it (fuse_gelu's input)."""

    def forward(self, x):
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class ErfGelu(nn.Module):
    """Exact GELU written out with erf."""

    def forward(self, x):
        return x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))


class Act(nn.Module):
    def __init__(self, fn: str):
        super().__init__()
        self.fn = fn
        self.module = {"relu": nn.ReLU, "relu_inplace": lambda: nn.ReLU(inplace=True), "relu_": None,
                       "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU,
                       "relu6": nn.ReLU6, "relu6_inplace": lambda: nn.ReLU6(inplace=True),
                       "hardtanh": lambda: nn.Hardtanh(-0.5, 0.5), "gelu_new": NewGelu, "gelu_erf": ErfGelu}[fn]
        if self.module is not None:
            self.module = self.module()

    def forward(self, x):
        return torch.relu_(x) if self.fn == "relu_" else self.module(x)


class Residual(nn.Module):
    def __init__(self, spec: L, shape):
        super().__init__()
        inner = []
        for sub in spec.inner:
            inner.append(_make(sub, shape))
            shape = out_shape(sub, shape)
        self.inner = nn.Sequential(*inner)
        self.proj = None if spec.proj is None else _make(spec.proj, None)
        self.proj_bn = nn.BatchNorm2d(spec.proj.cout) if spec.proj_bn else None
        self.add, self.shortcut_first = spec.add, spec.shortcut_first
        self.post = None if spec.post is None else Act(spec.post)

    def forward(self, x):
        shortcut = x if self.proj is None else self.proj(x)
        if self.proj_bn is not None:
            shortcut = self.proj_bn(shortcut)
        out = self.inner(x)
        if self.add == "add_":
            out = out.add_(shortcut)
        elif self.add == "+=":
            out += shortcut
        else:
            out = shortcut + out if self.shortcut_first else out + shortcut
        return out if self.post is None else self.post(out)


class Fork(nn.Module):
    def __init__(self, spec: L, shape):
        super().__init__()
        self.conv = _make(spec.conv, shape)
        shape = out_shape(spec.conv, shape)
        branch = []
        for sub in spec.branch:
            branch.append(_make(sub, shape))
        self.branch = nn.Sequential(*branch)
        self.combine = spec.combine

    def forward(self, x):
        y = self.conv(x)
        z = self.branch(y)
        if self.combine == "cat":
            return torch.cat([z, y], dim=1)
        return z + y if self.combine == "+" else z * y


class Shared(nn.Module):
    def __init__(self, spec: L, shape):
        super().__init__()
        self.conv = _make(spec.conv, shape)
        c = spec.conv.cout
        self.bn1 = nn.BatchNorm2d(c) if spec.bn else nn.Identity()
        self.bn2 = nn.BatchNorm2d(c) if spec.bn else nn.Identity()
        self.act = Act(spec.act) if spec.act else nn.Identity()

    def forward(self, x):
        return self.bn2(self.conv(self.act(self.bn1(self.conv(x)))))


class Dropout(nn.Module):
    def __init__(self, spec: L):
        super().__init__()
        self.p, self.variant, self.inplace = spec.p, spec.variant, spec.inplace
        self.module = {"module": nn.Dropout, "2d": nn.Dropout2d, "functional": None}[spec.variant]
        if self.module is not None:
            self.module = self.module(spec.p, inplace=spec.inplace)

    def forward(self, x):
        if self.module is None:
            return F.dropout(x, self.p, training=self.training, inplace=self.inplace)
        return self.module(x)


class InPlace(nn.Module):
    def __init__(self, spec: L):
        super().__init__()
        self.op = spec.op
        if spec.op == "add_param":
            self.shift = nn.Parameter(torch.randn(spec.shape) * 0.1)

    def forward(self, x):
        if self.op == "add_param":
            return x.add_(self.shift)
        if self.op == "add_scalar":
            return x.add_(0.25)
        if self.op == "mul_scalar":
            return x.mul_(0.5)
        return x.clamp_(-2.0, 2.0)


class Break(nn.Module):
    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def forward(self, x):
        if self.how == "item":
            return x * (1.0 / (1.0 + x.detach().abs().amax().item()))
        if self.how == "print":
            print("fuzz graph break", tuple(x.shape))
            return x
        torch._dynamo.graph_break()
        return x


class Head(nn.Module):
    def __init__(self, spec: L, shape):
        super().__init__()
        self.pool = spec.pool
        features = {"mean": shape[0], "amax": shape[0], "flatten": math.prod(shape), "none": shape[-1]}[spec.pool]
        self.fc = nn.Linear(features, spec.out, bias=spec.bias)

    def forward(self, x):
        if self.pool == "mean":
            x = x.mean((2, 3))
        elif self.pool == "amax":
            x = x.amax((2, 3))
        elif self.pool == "flatten":
            x = torch.flatten(x, 1)
        return self.fc(x)


def _make(layer: L, shape) -> nn.Module:
    kind = layer.kind
    if kind == "conv":
        return nn.Conv2d(layer.cin, layer.cout, layer.k, stride=layer.s, padding=layer.p, dilation=layer.d,
                         groups=layer.groups, bias=layer.bias)
    if kind == "linear":
        return nn.Linear(layer.fin, layer.out, bias=layer.bias)
    if kind == "bn":
        cls = nn.BatchNorm2d if layer.dims == 3 else nn.BatchNorm1d
        return cls(layer.c, affine=layer.affine, momentum=layer.momentum)
    if kind == "ln":
        return nn.LayerNorm(layer.f, elementwise_affine=layer.affine)
    if kind == "act":
        return Act(layer.fn)
    if kind == "res":
        return Residual(layer, shape)
    if kind == "fork":
        return Fork(layer, shape)
    if kind == "shared":
        return Shared(layer, shape)
    if kind == "pool":
        if layer.op == "adaptive":
            return nn.AdaptiveAvgPool2d(layer.size)
        if layer.op == "max":
            return nn.MaxPool2d(layer.k, layer.s, layer.p, ceil_mode=layer.ceil)
        return nn.AvgPool2d(layer.k, layer.s, layer.p, ceil_mode=layer.ceil,
                            count_include_pad=layer.count_include_pad)
    if kind == "dropout":
        return Dropout(layer)
    if kind == "inplace":
        return InPlace(layer)
    if kind == "break":
        return Break(layer.how)
    if kind == "attn":
        return Attention(layer)
    raise ValueError(f"unknown layer kind {kind!r}")


class Net(nn.Module):
    def __init__(self, spec: NetSpec):
        super().__init__()
        self.spec_text = spec.describe()
        shape, layers = spec.in_shape, []
        for layer in spec.layers:
            layers.append(_make(layer, shape))
            shape = out_shape(layer, shape)
        self.layers = nn.Sequential(*layers)
        self.head = None if spec.head is None else Head(spec.head, shape)

    def forward(self, x):
        x = self.layers(x)
        return x if self.head is None else self.head(x)

    def extra_repr(self):
        return self.spec_text


def randomize_norm_layers(model: nn.Module, seed: int) -> None:
    """Non-trivial BatchNorm statistics and affine parameters (folding must get them right)."""
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                c = m.num_features
                m.running_mean.copy_(torch.randn(c, generator=g) * 0.5)
                m.running_var.copy_(torch.rand(c, generator=g) * 1.5 + 0.5)
                if m.affine:
                    m.weight.copy_(torch.rand(c, generator=g) + 0.5)
                    m.bias.copy_(torch.randn(c, generator=g) * 0.2)
            elif isinstance(m, nn.LayerNorm) and m.elementwise_affine:
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.bias.shape, generator=g) * 0.2)


