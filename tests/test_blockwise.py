"""Neither dynamo nor torch.fx captures the forward: its blocks are captured one by one."""
import copy

import pytest
import torch
import torch.nn as nn

import fxdream
from conftest import assert_same_training_step


def conv_bn_relu(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU())


class EarlyExit(nn.Module):
    """A data-dependent break inside the loop over the blocks: dynamo gives up on the whole
    forward, and torch.fx cannot trace ``float()`` of a proxy."""
    def __init__(self):
        super().__init__()
        self.stem = conv_bn_relu(3, 8)
        self.blocks = nn.ModuleList(conv_bn_relu(8, 8) for _ in range(3))
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
            if float(x.mean()) > 100.0:  # never true here; dynamo cannot know
                break
        return self.head(x.mean((2, 3)))


def _no_compiled_slots(model):
    return all(m._compiled_call_impl is None for m in model.modules())


def test_inference_captures_each_block_and_equals_eager():
    torch.manual_seed(0)
    model, x = EarlyExit().eval(), torch.randn(2, 3, 16, 16)
    optimized = fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"])
    report = optimized.report
    assert report.capture.startswith("dynamo per block, the forward eager (5 modules it calls")
    assert not report.ran_eagerly and report.graph_breaks  # the break that made the forward eager
    assert len(report.graphs) == 5  # one per block: the stem, the three in the list, the head
    assert any(row.name == "fuse_conv_bias_act" and row.applied for row in report.passes)
    assert _no_compiled_slots(model)  # the model is as it was between calls
    for batch in (2, 5):
        y = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            torch.testing.assert_close(optimized(y), model(y), atol=1e-4, rtol=1e-4)
    assert _no_compiled_slots(model)


def test_each_blocks_layers_are_named_as_in_the_model():
    """A block compiled on its own sits at its qualified name inside fxdream's wrapper: its ops'
    layers are the model's ("blocks.1.0", a block's convolution), not the wrapper's."""
    model, x = EarlyExit().eval(), torch.randn(2, 3, 16, 16)
    captured = fxdream.capture(model, (x,))
    layers = [{n.meta["layer"] for n in c.forward.graph.nodes if n.op == "call_function"} for c in captured]
    assert layers[0] == {"stem.0", "stem.1", "stem.2"} and layers[-1] == {"head"}
    assert {"blocks.1.0", "blocks.1.1", "blocks.1.2"} <= layers[2]
    assert not any("block_" in layer or layer.startswith("block.") for group in layers for layer in group)


def test_training_steps_equal_eager_with_hooks_still_called():
    torch.manual_seed(0)
    model, x = EarlyExit().train(), torch.randn(2, 3, 16, 16)
    calls = []
    model.blocks[1].register_forward_hook(lambda module, args, out: calls.append(out.shape))
    reference = copy.deepcopy(model)
    optimized = fxdream.optimize(model, (x,), training=True)
    assert optimized.report.capture.startswith("dynamo per block")
    calls.clear()
    assert assert_same_training_step(model, optimized, (x,)) > 0
    assert len(calls) == 2  # the hook ran in the deep copy's eager step and in the captured one
    reference(x)  # one training step each: BN statistics alike
    for a, b in zip(model.buffers(), reference.buffers()):
        torch.testing.assert_close(a.float(), b.float())


def test_strict_refuses_a_forward_that_runs_eagerly():
    with pytest.raises(fxdream.CaptureError, match="not captured whole"):
        fxdream.optimize(EarlyExit().eval(), (torch.randn(2, 3, 16, 16),), strict=True)


def test_capture_and_simulate_take_the_blocks_too():
    model, x = EarlyExit().eval(), torch.randn(2, 3, 16, 16)
    captured = fxdream.capture(model, (x,))
    assert isinstance(captured, tuple) and len(captured) == 5  # one graph per block
    assert fxdream.simulate(model, (x,), device="h100", training=True).time_ms > 0


class CallsGrandchildren(nn.Module):
    """The forward calls the blocks of a submodule directly (``self.net.blocks[i]``), never ``self.net``."""
    def __init__(self):
        super().__init__()
        self.net = EarlyExit()

    def forward(self, x):
        x = self.net.stem(x)
        for block in self.net.blocks:
            x = block(x)
            if float(x.mean()) > 100.0:
                break
        return self.net.head(x.mean((2, 3)))


def test_the_blocks_are_the_modules_the_forward_calls_not_just_its_children():
    torch.manual_seed(0)
    model, x = CallsGrandchildren().eval(), torch.randn(2, 3, 16, 16)
    optimized = fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"])
    assert optimized.report.capture.startswith("dynamo per block, the forward eager (5 modules it calls")
    assert len(optimized.report.graphs) == 5 and _no_compiled_slots(model)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x), atol=1e-4, rtol=1e-4)


class _Block(nn.Module):
    def __init__(s):  # ``s``, not ``self``: dynamo's sources name the frame's locals as written
        super().__init__()
        s.fc, s.ln = nn.Linear(8, 8), nn.LayerNorm(8)

    def forward(s, x):
        return x + s.fc(s.ln(x)).relu()


class _BreaksBetweenBlocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
            if float(x.mean()) > 1e9:  # dynamo gives up on this frame and compiles each block's forward
                break
        return x


def test_a_blocks_frame_is_named_by_its_parameters_whatever_its_self_is_called():
    captured = fxdream.capture(_BreaksBetweenBlocks().eval(), (torch.randn(4, 8),))
    layers = {n.meta["layer"] for n in captured.forward.graph.nodes if n.op == "call_function"}
    assert layers == {"blocks.0.ln", "blocks.0.fc", "blocks.0"}  # the first block's call named the graph


@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("device", ["h100", "cpu"])
def test_each_call_of_a_graph_shared_by_blocks_is_costed_as_its_own_blocks_layers(training, device):
    """Dynamo compiles the block class's forward once and calls it per block: a prediction places
    each call at the block it ran on, by the parameters it took, forward and backward; for
    another device (the step recorded) and for this machine (the step measured) alike."""
    prediction = fxdream.simulate(_BreaksBetweenBlocks().train(training), (torch.randn(4, 8),), device=device,
                                  training=training)
    per_layer = prediction.timeline.per_layer_us
    assert {"blocks.0.fc", "blocks.1.fc", "blocks.0.ln", "blocks.1.ln"} <= set(per_layer)
    if device != "cpu":  # measured costs vary call by call
        assert per_layer["blocks.0.fc"] == pytest.approx(per_layer["blocks.1.fc"])  # the same work, each its own
    if training:
        backward = {t.layer for t in prediction.task_graph.tasks if t.phase == "bw" and t.layer}
        assert {"blocks.0.fc", "blocks.1.fc"} <= backward
