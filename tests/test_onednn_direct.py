"""The trial calls that decide whether a prepacked conv may call oneDNN directly."""
import torch
import torch.fx as fx

from fxdream.ops import ONEDNN_CONV
from fxdream.onednn_direct import TrialTensor, _runs_on_real_tensors, trial_layouts

CL = torch.channels_last


def _conv_call(x: torch.Tensor, kernel: int, stride: int, padding: int):
    """A graph module and the direct call's args: x a placeholder holding ``x``, the weight an attribute."""
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    gm.register_buffer("w", torch.randn(4, x.shape[1], kernel, kernel))
    node, weight = gm.graph.placeholder("x"), gm.graph.get_attr("w")
    node.meta["val"] = x
    return gm, (node, weight, None, [padding] * 2, [stride] * 2, [1, 1], 1, "relu", [], "")


def test_a_trial_keeps_the_layout_and_cuts_the_spatial_size_to_a_2x2_output():
    gm, args = _conv_call(torch.randn(8, 3, 224, 224).contiguous(memory_format=CL), 7, 2, 3)
    x = trial_layouts(gm, ONEDNN_CONV, args)[0]
    assert isinstance(x, TrialTensor) and x == ((2, 3, 3, 3), [0, 2, 3, 1], torch.float32)
    assert (3 + 2 * 3 - 7) // 2 + 1 == 2  # the output a 3x3 input gives: 2x2
    gm, args = _conv_call(torch.randn(1, 8, 16, 16), 3, 1, 1)
    assert trial_layouts(gm, ONEDNN_CONV, args)[0] == ((1, 8, 2, 2), [0, 1, 2, 3], torch.float32)


def test_size_1_dims_keep_their_strides_order():
    """A 1x1 map is NCHW and channels_last at once: its strides say which, and oneDNN may care."""
    x = torch.empty_strided((1, 8, 1, 1), (8, 1, 8, 8))  # as channels_last made it
    gm, args = _conv_call(x, 1, 1, 0)
    assert trial_layouts(gm, ONEDNN_CONV, args)[0] == ((1, 8, 1, 1), [0, 2, 3, 1], torch.float32)
    trial = torch.empty_permuted((1, 8, 1, 1), [0, 2, 3, 1])
    assert trial.stride() == x.stride()


def test_a_trial_runs_once_per_layout_and_a_rejected_layout_is_remembered():
    calls = []

    def picky(x, *rest):  # rejects channels_last inputs, as oneDNN rejects some layouts
        calls.append(x.stride())
        if not x.is_contiguous():
            raise RuntimeError("could not create a memory")
        return x

    def runs(x):
        gm, args = _conv_call(x, 3, 1, 1)
        return _runs_on_real_tensors(gm, picky, args)

    nchw, channels_last = torch.randn(2, 5, 9, 9), torch.randn(2, 5, 9, 9).contiguous(memory_format=CL)
    assert runs(nchw) is True
    assert runs(torch.randn(2, 5, 9, 9)) is True  # alike: not run again
    assert runs(channels_last) is False
    assert runs(channels_last) is False
    assert calls == [(20, 4, 2, 1), (20, 1, 10, 5)]  # two trials, each on a 2x2 map (from 9x9)
