"""The trial calls that decide whether a prepacked conv may call oneDNN directly."""
import torch
import torch.fx as fx

from fxdream.runtime.onednn_direct import TrialTensor, _runs_on_real_tensors, trial_layouts

CL = torch.channels_last


def _conv_call(x: torch.Tensor):
    """A graph module and a direct conv call's args: x a placeholder holding ``x``, the weight an attribute."""
    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    gm.register_buffer("w", torch.randn(4, x.shape[1], 3, 3))
    node, weight = gm.graph.placeholder("x"), gm.graph.get_attr("w")
    node.meta["val"] = x
    return gm, (node, weight, None, [1, 1], [1, 1], [1, 1], 1, "relu", [], "")


def test_a_trial_takes_the_activations_shapes_and_strides_and_the_weights_as_they_are():
    """Strides as they are: a 1x1 map is NCHW and channels_last at once, and oneDNN may care which."""
    x = torch.empty_strided((1, 8, 1, 1), (8, 1, 8, 8))  # as channels_last made it
    gm, args = _conv_call(x)
    trial = trial_layouts(gm, args)
    assert isinstance(trial[0], TrialTensor) and trial[0] == ((1, 8, 1, 1), (8, 1, 8, 8), torch.float32)
    assert trial[1] is gm.w and trial[2:] == list(args[2:])


def test_a_trial_runs_once_per_layout_and_a_rejected_layout_is_remembered():
    calls = []

    def picky(x, *rest):  # rejects channels_last inputs, as oneDNN rejects some layouts
        calls.append(x.stride())
        if not x.is_contiguous():
            raise RuntimeError("could not create a memory")
        return x

    def runs(x):
        gm, args = _conv_call(x)
        return _runs_on_real_tensors(gm, picky, args)

    nchw, channels_last = torch.randn(2, 5, 9, 9), torch.randn(2, 5, 9, 9).contiguous(memory_format=CL)
    assert runs(nchw) is True
    assert runs(torch.randn(2, 5, 9, 9)) is True  # alike: not run again
    assert runs(channels_last) is False
    assert runs(channels_last) is False
    assert calls == [(405, 81, 9, 1), (405, 1, 45, 5)]  # two trials, on tensors laid out as the arguments
