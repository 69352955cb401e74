"""Random small nets for fuzzing ``fxdream.optimize``: a hypothesis strategy (the spec it draws is
in ``spec.py``, the modules built from it in ``modules.py``).

A net is drawn as a ``NetSpec``: plain data whose ``repr`` is valid Python (paste a
falsifying example into a regression test as is) and whose ``describe()`` reads as a
layer table with shapes. ``spec.build()`` returns ``(model, inputs)``, the same every
time for the same spec: parameters, BatchNorm statistics and inputs all come from
``spec.seed``.

Conv nets stack blocks from: Conv2d (kernel 1/3/5, stride 1/2, padding, groups, bias,
dilation), BatchNorm2d, activations (ReLU, ReLU(inplace), relu_, GELU, GELU(tanh),
SiLU, ReLU6, Hardtanh, GELU written out in its tanh and erf forms), residual blocks (identity
or projection shortcut, ``+``, ``add_`` or ``+=``, both operand orders, optional activation
after the add: the
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

from hypothesis import strategies as st

from .attention import attention_layer
from .spec import L, NetSpec, conv_len, out_shape, pool_len  # noqa: F401  (NetSpec: with the strategy)

MAX_CHANNELS = 16
MAX_SPATIAL = 16
MAX_FEATURES = 16


# --------------------------------------------------------------------------------------------
# the strategy
# --------------------------------------------------------------------------------------------

ACTS = ("relu", "relu_inplace", "relu_", "gelu", "gelu_tanh", "silu", "relu6", "relu6_inplace", "hardtanh",
        "gelu_new", "gelu_erf")
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
        if min(conv_len(h, k, s, p, d), conv_len(w, k, s, p, d)) < 1:
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
    if min(pool_len(h, k, s, p, ceil), pool_len(w, k, s, p, ceil)) < 1 or min(h, w) + 2 * p < k:
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
