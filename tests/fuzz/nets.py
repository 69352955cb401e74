"""Random small nets for fuzzing ``fxdream.optimize``: a hypothesis strategy and a builder.

A net is drawn as a ``NetSpec``: plain data whose ``repr`` is valid Python (paste a
falsifying example into a regression test as is) and whose ``describe()`` reads as a
layer table with shapes. ``spec.build()`` returns ``(model, inputs)``, the same every
time for the same spec: parameters, BatchNorm statistics and inputs all come from
``spec.seed``.

Conv nets stack blocks from: Conv2d (kernel 1/3/5, stride 1/2, padding, groups, bias,
dilation), BatchNorm2d, activations (ReLU, ReLU(inplace), relu_, GELU, GELU(tanh),
SiLU, ReLU6, Hardtanh), residual blocks (identity or projection shortcut, ``+``,
``add_`` or ``+=``, both operand orders, optional activation after the add: the
conv→add→relu pattern), forks (a conv whose output is used twice), a conv shared by
two call sites, max/avg/adaptive pooling, dropout (also 2d, functional, in-place),
in-place arithmetic, and a head (mean/amax/flatten → Linear). MLP nets use Linear,
BatchNorm1d, LayerNorm, activations, residuals, dropout and in-place ops on 2-D or
3-D inputs, and on 3-D inputs attention as matmul / softmax / matmul (tests/fuzz/attention.py).
Either kind sometimes has a graph break (``.item()``, ``print``,
``torch._dynamo.graph_break()``).

Every drawn net runs in eager mode: in-place ops are only drawn where autograd allows
them (never on the net's input, nor on a tensor saved for backward, such as a ReLU's
result), and BatchNorm in training always sees more than one value per channel.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import strategies as st

from .attention import Attention, attention_layer
from .attention import describe as describe_attention

MAX_CHANNELS = 16
MAX_SPATIAL = 16
MAX_FEATURES = 16


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
        torch.manual_seed(self.seed)
        model = Net(self)
        _randomize_norm_layers(model, self.seed)
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
            lines.append(f"  {i:>2}: {_describe(layer):<72} -> {shape}")
        if self.head is not None:
            lines.append(f"  head: {_describe(self.head)}")
        return "\n".join(lines)


def _breaks(layer: L) -> bool:
    if layer.kind == "break" or (layer.kind == "bn" and layer.momentum is None):
        return True
    return any(_breaks(sub) for sub in layer.kw.get("inner", ()) + layer.kw.get("branch", ()))


# --------------------------------------------------------------------------------------------
# shapes
# --------------------------------------------------------------------------------------------

def _conv_len(n, k, s, p, d):
    return (n + 2 * p - d * (k - 1) - 1) // s + 1


def _pool_len(n, k, s, p, ceil_mode):
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
        return (layer.cout, _conv_len(h, layer.k, layer.s, layer.p, layer.d),
                _conv_len(w, layer.k, layer.s, layer.p, layer.d))
    if kind == "pool":
        c, h, w = shape
        if layer.op == "adaptive":
            return (c, layer.size, layer.size)
        return (c, _pool_len(h, layer.k, layer.s, layer.p, layer.ceil),
                _pool_len(w, layer.k, layer.s, layer.p, layer.ceil))
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
# the strategy
# --------------------------------------------------------------------------------------------

ACTS = ("relu", "relu_inplace", "relu_", "gelu", "gelu_tanh", "silu", "relu6", "relu6_inplace", "hardtanh")
# the result is saved for backward (relu) or the op is in place: a later in-place op on it
# would make eager autograd fail
_ACT_SAVES_RESULT = {"relu", "relu_inplace", "relu_", "relu6_inplace"}


@dataclasses.dataclass
class _State:
    """What the generator knows about the tensor flowing out of the last layer."""
    shape: tuple
    batch: int
    training: bool
    pristine: bool = True   # the net's input (or an alias of it): never modify in place
    saved: bool = False     # saved for backward by its producer: never modify in place

    @property
    def inplace_ok(self) -> bool:
        return not self.pristine and not self.saved

    def after(self, layer: L) -> None:
        self.shape = out_shape(layer, self.shape)
        if layer.kind == "dropout" and not layer.inplace:
            return  # p=0 or eval dropout returns its input itself: the flags carry over
        if layer.kind == "break":
            return
        self.pristine = False
        self.saved = (layer.kind == "act" and layer.fn in _ACT_SAVES_RESULT) or \
            (layer.kind in ("inplace", "dropout")) or \
            (layer.kind == "res" and layer.post in _ACT_SAVES_RESULT)


def _rare(draw, one_in: int) -> bool:
    """True about once in ``one_in`` draws; shrinks to False."""
    return draw(st.integers(0, one_in - 1)) == one_in - 1


def _divisors(n):
    return [d for d in range(1, n + 1) if n % d == 0]


@st.composite
def conv_layer(draw, shape, *, same=False, stride=None, cout=None):
    """A Conv2d for (C, H, W) input; ``same``: output spatial size equals the input's."""
    cin, h, w = shape
    if cout is None:
        cout = draw(st.integers(1, MAX_CHANNELS))
    groups = draw(st.sampled_from([g for g in _divisors(math.gcd(cin, cout))]))
    d = 2 if _rare(draw, 5) else 1
    k = draw(st.sampled_from([3, 1, 5]))
    s = 1 if same else (stride if stride is not None else draw(st.sampled_from([1, 2])))
    half = d * (k - 1) // 2  # odd kernels: this padding keeps the size at stride 1
    if same:
        p = half
    else:
        p = draw(st.integers(0, half))
        if min(_conv_len(h, k, s, p, d), _conv_len(w, k, s, p, d)) < 1:
            p = half
    bias = draw(st.booleans())
    return L("conv", cin=cin, cout=cout, k=k, s=s, p=p, d=d, groups=groups, bias=bias)


@st.composite
def act_layer(draw, state):
    choices = [a for a in ACTS if state.inplace_ok or a not in ("relu_inplace", "relu_", "relu6_inplace")]
    return L("act", fn=draw(st.sampled_from(choices)))


@st.composite
def bn_layer(draw, state):
    dims = len(state.shape)
    momentum = None if _rare(draw, 5) else 0.1
    return L("bn", c=state.shape[0] if dims == 3 else state.shape[-1], dims=dims,
             affine=not _rare(draw, 4), momentum=momentum)


def _bn_ok(state) -> bool:
    if len(state.shape) == 3:  # BatchNorm2d
        return not state.training or state.batch * state.shape[1] * state.shape[2] > 1
    if len(state.shape) == 1:  # BatchNorm1d on (N, F)
        return not state.training or state.batch > 1
    return False


@st.composite
def _tail(draw, state, max_len):
    """Conv/linear followed by up to ``max_len`` bn/act layers (same shape): a block's body."""
    layers = []
    for _ in range(draw(st.integers(0, max_len))):
        kinds = ["act"] + (["bn"] if _bn_ok(state) else [])
        kind = draw(st.sampled_from(kinds))
        layer = draw(act_layer(state)) if kind == "act" else draw(bn_layer(state))
        layers.append(layer)
        state.after(layer)
    return layers


@st.composite
def res_block(draw, state):
    """out = inner(x) (+) shortcut(x), then maybe an activation."""
    conv_net = len(state.shape) == 3
    downsample = conv_net and draw(st.booleans()) and min(state.shape[1:]) > 1
    change_width = draw(st.booleans())
    width = draw(st.integers(1, MAX_CHANNELS if conv_net else MAX_FEATURES)) if change_width \
        else (state.shape[0] if conv_net else state.shape[-1])
    inner_state = dataclasses.replace(state, pristine=False, saved=False)
    inner = []
    if conv_net:
        first = draw(conv_layer(state.shape, cout=width, stride=2 if downsample else 1,
                                same=not downsample))
        if downsample:  # match the projection's size: odd kernel, padding k//2
            first = L("conv", **{**first.kw, "d": 1, "k": 3, "p": 1})
    else:
        first = L("linear", fin=state.shape[-1], out=width, bias=draw(st.booleans()))
    inner.append(first)
    inner_state.after(first)
    inner += draw(_tail(inner_state, 2))
    if draw(st.booleans()):  # a second conv/linear: ends the block on it (conv→add→relu)
        second = draw(conv_layer(inner_state.shape, cout=width, same=True)) if conv_net \
            else L("linear", fin=width, out=width, bias=draw(st.booleans()))
        inner.append(second)
        inner_state.after(second)
        if _rare(draw, 3):
            inner += draw(_tail(inner_state, 1))
    projection = downsample or width != (state.shape[0] if conv_net else state.shape[-1]) or _rare(draw, 4)
    proj = None
    if projection:
        if conv_net:
            proj = L("conv", cin=state.shape[0], cout=width, k=1, s=2 if downsample else 1, p=0, d=1,
                     groups=1, bias=draw(st.booleans()))
        else:
            proj = L("linear", fin=state.shape[-1], out=width, bias=draw(st.booleans()))
    proj_bn = conv_net and projection and _bn_ok(dataclasses.replace(state, shape=out_shape(proj, state.shape))) \
        and draw(st.booleans())
    adds = ["+"] + (["add_", "+="] if inner_state.inplace_ok else [])
    post = draw(st.sampled_from(ACTS)) if draw(st.booleans()) else None
    return L("res", inner=tuple(inner), proj=proj, proj_bn=proj_bn, add=draw(st.sampled_from(adds)),
             shortcut_first=draw(st.booleans()), post=post)


@st.composite
def fork_block(draw, state):
    """y = conv(x); out = combine(branch(y), y): the conv's output has two users."""
    conv = draw(conv_layer(state.shape))
    branch_state = dataclasses.replace(state, shape=out_shape(conv, state.shape), pristine=False, saved=False)
    branch = []
    for _ in range(draw(st.integers(1, 2))):
        kinds = ["act"] + (["bn"] if _bn_ok(branch_state) else [])
        kind = draw(st.sampled_from(kinds))
        layer = draw(act_layer(branch_state)) if kind == "act" else draw(bn_layer(branch_state))
        branch.append(layer)
        branch_state.after(layer)
    combines = ["+", "*"] + (["cat"] if 2 * conv.cout <= MAX_CHANNELS else [])
    return L("fork", conv=conv, branch=tuple(branch), combine=draw(st.sampled_from(combines)))


@st.composite
def shared_block(draw, state):
    """One Conv2d called twice (shared weights), each call followed by its own BatchNorm."""
    conv = draw(conv_layer(state.shape, cout=state.shape[0], same=True))
    return L("shared", conv=conv, bn=_bn_ok(state) and draw(st.booleans()),
             act=draw(st.sampled_from(["relu", "gelu", "silu", None])))


@st.composite
def pool_layer(draw, state):
    c, h, w = state.shape
    op = draw(st.sampled_from(["max", "avg", "adaptive"]))
    if op == "adaptive":
        return L("pool", op=op, size=draw(st.integers(1, min(2, h, w))))
    k = draw(st.sampled_from([2, 3]))
    s = draw(st.sampled_from([2, 1]))
    p = draw(st.integers(0, k // 2))
    ceil = _rare(draw, 4)
    if min(_pool_len(h, k, s, p, ceil), _pool_len(w, k, s, p, ceil)) < 1 or min(h, w) + 2 * p < k:
        p = k // 2
    extra = {"count_include_pad": draw(st.booleans())} if op == "avg" else {}
    return L("pool", op=op, k=k, s=s, p=p, ceil=ceil, **extra)


@st.composite
def dropout_layer(draw, state):
    variants = ["module", "functional"] + (["2d"] if len(state.shape) == 3 else [])
    return L("dropout", p=draw(st.sampled_from([0.5, 0.0, 0.2])), variant=draw(st.sampled_from(variants)),
             inplace=state.inplace_ok and _rare(draw, 3))


@st.composite
def inplace_layer(draw, state):
    return L("inplace", op=draw(st.sampled_from(["add_param", "add_scalar", "mul_scalar", "clamp_"])),
             shape=(state.shape[0], 1, 1) if len(state.shape) == 3 else (state.shape[-1],))


@st.composite
def conv_nets(draw, training: bool):
    batch = draw(st.integers(1, 3))
    c = draw(st.integers(1, 4))
    h = draw(st.integers(1, MAX_SPATIAL))
    w = draw(st.integers(1, MAX_SPATIAL)) if _rare(draw, 3) else h
    state = _State((c, h, w), batch, training)
    layers = []
    n = draw(st.integers(1, 6))
    for i in range(n):
        kinds = ["conv", "act", "res"]
        if _bn_ok(state):
            kinds.append("bn")
        kinds += ["fork", "pool", "dropout", "shared"]
        if state.inplace_ok:
            kinds.append("inplace")
        if i == 0:  # a stem with parameters: every net has gradients to compare
            kinds = ["conv", "res", "fork", "shared"]
        kind = draw(st.sampled_from(kinds))
        layer = {"conv": lambda: conv_layer(state.shape), "act": lambda: act_layer(state),
                 "bn": lambda: bn_layer(state), "res": lambda: res_block(state),
                 "fork": lambda: fork_block(state), "pool": lambda: pool_layer(state),
                 "dropout": lambda: dropout_layer(state), "shared": lambda: shared_block(state),
                 "inplace": lambda: inplace_layer(state)}[kind]()
        layer = draw(layer)
        layers.append(layer)
        state.after(layer)
        # a BN right after a conv is the pattern folding looks for: make it common
        if kind == "conv" and _bn_ok(state) and draw(st.booleans()):
            layers.append(draw(bn_layer(state)))
            state.after(layers[-1])
    if _rare(draw, 8):
        at = draw(st.integers(0, len(layers)))
        layers.insert(at, L("break", how=draw(st.sampled_from(["item", "print", "graph_break"]))))
    head = None
    if draw(st.integers(0, 3)) > 0:
        head = L("head", pool=draw(st.sampled_from(["mean", "flatten", "amax"])), out=draw(st.integers(1, 10)),
                 bias=draw(st.booleans()))
    return NetSpec("conv", batch, (c, h, w), tuple(layers), head, draw(st.integers(0, 2**16)))


@st.composite
def mlp_nets(draw, training: bool):
    batch = draw(st.integers(1, 3))
    f = draw(st.integers(1, MAX_FEATURES))
    shape = (draw(st.integers(1, 4)), f) if _rare(draw, 3) else (f,)
    state = _State(shape, batch, training)
    layers = []
    for i in range(draw(st.integers(1, 5))):
        kinds = ["linear", "act", "res", "ln", "dropout"]
        if len(state.shape) == 2:
            kinds.append("attn")
        if _bn_ok(state):
            kinds.append("bn")
        if state.inplace_ok:
            kinds.append("inplace")
        if i == 0:
            kinds = ["linear", "res"]
        kind = draw(st.sampled_from(kinds))
        if kind == "linear":
            layer = L("linear", fin=state.shape[-1], out=draw(st.integers(1, MAX_FEATURES)), bias=draw(st.booleans()))
        elif kind == "ln":
            layer = L("ln", f=state.shape[-1], affine=draw(st.booleans()))
        elif kind == "attn":
            layer = L(**draw(attention_layer(state.shape[-1], state.shape[0])))
        else:
            layer = draw({"act": lambda: act_layer(state), "res": lambda: res_block(state),
                          "bn": lambda: bn_layer(state), "dropout": lambda: dropout_layer(state),
                          "inplace": lambda: inplace_layer(state)}[kind]())
        layers.append(layer)
        state.after(layer)
    if _rare(draw, 8):
        at = draw(st.integers(0, len(layers)))
        layers.insert(at, L("break", how=draw(st.sampled_from(["item", "print", "graph_break"]))))
    head = L("head", pool="none", out=draw(st.integers(1, 10)), bias=draw(st.booleans())) if draw(st.booleans()) else None
    return NetSpec("mlp", batch, shape, tuple(layers), head, draw(st.integers(0, 2**16)))


def nets(training: bool):
    """Conv nets mostly, MLP-only nets about one time in five."""
    return st.integers(0, 4).flatmap(lambda i: mlp_nets(training) if i == 4 else conv_nets(training))


# --------------------------------------------------------------------------------------------
# the builder
# --------------------------------------------------------------------------------------------

class Act(nn.Module):
    def __init__(self, fn: str):
        super().__init__()
        self.fn = fn
        self.module = {"relu": nn.ReLU, "relu_inplace": lambda: nn.ReLU(inplace=True), "relu_": None,
                       "gelu": nn.GELU, "gelu_tanh": lambda: nn.GELU(approximate="tanh"), "silu": nn.SiLU,
                       "relu6": nn.ReLU6, "relu6_inplace": lambda: nn.ReLU6(inplace=True),
                       "hardtanh": lambda: nn.Hardtanh(-0.5, 0.5)}[fn]
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


def _randomize_norm_layers(model: nn.Module, seed: int) -> None:
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


# --------------------------------------------------------------------------------------------
# describe
# --------------------------------------------------------------------------------------------

def _describe(layer: L) -> str:
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
                "relu6_inplace": "ReLU6(inplace=True)", "hardtanh": "Hardtanh(-0.5, 0.5)"}[layer.fn]
    if k == "res":
        inner = " → ".join(_describe(s) for s in layer.inner)
        short = "x" if layer.proj is None else _describe(layer.proj) + (" → BN" if layer.proj_bn else "")
        op = {"+": "+", "add_": ".add_", "+=": "+="}[layer.add]
        order = f"shortcut {op} inner" if layer.shortcut_first and layer.add == "+" else f"inner {op} shortcut"
        post = f" → {_describe(L('act', fn=layer.post))}" if layer.post else ""
        return f"Residual[{order}; inner: {inner}; shortcut: {short}]{post}"
    if k == "fork":
        branch = " → ".join(_describe(s) for s in layer.branch)
        return f"Fork[y = {_describe(layer.conv)}; {layer.combine}(({branch})(y), y)]"
    if k == "shared":
        bn = "BN_i" if layer.bn else ""
        act = _describe(L("act", fn=layer.act)) if layer.act else ""
        return f"Shared[same {_describe(layer.conv)} twice, {' → '.join(filter(None, ['conv', bn, act, 'conv', bn]))}]"
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
