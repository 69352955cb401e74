"""What an op holds while it runs beyond its outputs (fxdream.sim.workspaces), worked out by hand
and, for whole steps, against the allocator's records (tests/test_memory_check.py)."""
import pytest
import torch
import torch.fx as fx

import fxdream
from fxdream.memory_check import allocated_peak_bytes_during
from fxdream.sim.workspaces import CHANNEL_BLOCK, workspace_bytes
from conftest import RecordValues

aten = torch.ops.aten


def _conv_node(x: torch.Tensor, out_channels: int, kernel: int = 3) -> fx.Node:
    graph = fx.Graph()
    placeholder = graph.placeholder("x")
    weight = graph.create_node("get_attr", "weight")
    conv = graph.call_function(aten.convolution.default, (placeholder, weight, None, [1, 1], [kernel // 2] * 2,
                                                          [1, 1], False, [0, 0], 1))
    graph.output(conv)
    root = torch.nn.Module()
    root.weight = torch.nn.Parameter(torch.randn(out_channels, x.shape[1], kernel, kernel, dtype=x.dtype,
                                                 device=x.device))
    gm = fx.GraphModule(root, graph)
    RecordValues(gm).run(x)
    for node in gm.graph.nodes:  # the weight's value, as a captured graph's placeholder carries it
        if node.op == "get_attr":
            node.meta["val"] = root.weight.detach()
    return conv


FLOAT = 4


def test_an_nchw_convolution_holds_its_reordered_input_and_weight_or_its_blocked_output():
    conv = _conv_node(torch.randn(2, 8, 6, 6), 16)  # batch 2: oneDNN, not the slow path
    source, weight, output = 2 * 8 * 36 * FLOAT, 16 * 8 * 9 * FLOAT, 2 * 16 * 36 * FLOAT
    assert workspace_bytes(conv, "cpu") == max(source + weight, output) == 6912


def test_a_few_channels_are_read_as_they_are_and_channels_last_reorders_only_the_weight():
    rgb = _conv_node(torch.randn(2, 3, 6, 6), 16)
    assert workspace_bytes(rgb, "cpu") == max(16 * 3 * 9 * FLOAT, 2 * 16 * 36 * FLOAT)  # the blocked output
    # fewer output channels than a block: the blocked output holds the padded channels
    narrow = _conv_node(torch.randn(2, 3, 6, 6), 8)
    assert workspace_bytes(narrow, "cpu") == 2 * max(8, CHANNEL_BLOCK) * 36 * FLOAT
    channels_last = _conv_node(torch.randn(2, 8, 6, 6).to(memory_format=torch.channels_last), 16)
    assert workspace_bytes(channels_last, "cpu") == 16 * 8 * 9 * FLOAT
    assert workspace_bytes(channels_last, "cuda") == 0  # float32 on cuDNN: chosen at run time, not held


def test_atens_slow_convolution_unfolds_its_input_into_columns():
    conv = _conv_node(torch.randn(1, 8, 6, 6), 16)  # batch 1, 3x3, 288 values: ATen's slow path
    assert workspace_bytes(conv, "cpu") == 8 * 9 * 36 * FLOAT


def test_an_lstm_layer_copies_its_weights_and_keeps_its_gates():
    lstm = torch.nn.LSTM(8, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 8)
    captured = fxdream.capture(lstm, (x,))
    layer = next(n for n in captured.forward.graph.nodes if n.target == aten.mkldnn_rnn_layer.default)
    weights = (16 * 8 + 16 * 4 + 16) * FLOAT  # input-to-hidden, hidden-to-hidden, bias (4 gates x hidden 4)
    gates = 5 * 2 * 16 * FLOAT
    assert workspace_bytes(layer, "cpu") == weights + gates


@pytest.mark.parametrize("channels_last", [False, True])
def test_a_conv_steps_predicted_peak_is_the_allocators(channels_last):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 3, padding=1), torch.nn.ReLU(),
                                torch.nn.Conv2d(32, 32, 3, padding=1)).eval()
    x = torch.randn(4, 16, 32, 32)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.to(memory_format=torch.channels_last)
    predicted = fxdream.simulate(model, (x,), device="cpu", cost="analytic")
    captured = fxdream.optimize(model, (x,), cost=None)

    def step():
        with torch.no_grad():
            captured(x)
    step()
    measured = allocated_peak_bytes_during(step)
    assert predicted.peak_memory_bytes - predicted.static_bytes == pytest.approx(measured, rel=0.02)


def test_an_lstm_captured_on_the_meta_device_is_one_op_holding_its_largest_layers_workspace():
    """On the meta device ATen would unroll an LSTM step by step; it is kept whole as the CPU
    (oneDNN) and the GPU (cuDNN) run it, and on a CPU it holds its largest layer's copies."""
    with torch.device("meta"):
        lstm = torch.nn.LSTM(8, 4, num_layers=2, bidirectional=True, batch_first=True).eval()
        x = torch.empty(2, 5, 8)
    prediction = fxdream.simulate(lstm, (x,), device="cpu", cost="analytic")
    ops = [t.op for t in prediction.task_graph.tasks]
    assert ops.count("fxdream.lstm_inference") == 1 and "aten.sigmoid" not in ops
    layer = next(t for t in prediction.task_graph.tasks if t.op == "fxdream.lstm_inference")
    # the second layer reads both directions (8 wide): its input weights 16x8 like the first's
    weights = (16 * 8 + 16 * 4 + 16) * FLOAT  # input-to-hidden, hidden-to-hidden, one bias
    outputs = (2 * 5 * 8 + 2 * (4 * 2 * 4)) * FLOAT  # (2, 5, 2x4) and h, c of (4, 2, 4)
    assert layer.mem_alloc == outputs + weights + 5 * 2 * 16 * FLOAT
    assert layer.mem_free >= weights + 5 * 2 * 16 * FLOAT


def _conv_backward_node(x: torch.Tensor, out_channels: int, kernel: int = 3) -> fx.Node:
    graph = fx.Graph()
    grad, inp, weight = graph.placeholder("grad"), graph.placeholder("x"), graph.placeholder("w")
    node = graph.call_function(aten.convolution_backward.default, (grad, inp, weight, [out_channels], [1, 1],
                                                                   [kernel // 2] * 2, [1, 1], False, [0, 0], 1,
                                                                   [True, True, True]))
    graph.output(node)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    w = torch.randn(out_channels, x.shape[1], kernel, kernel, dtype=x.dtype, device=x.device)
    RecordValues(gm).run(torch.randn(x.shape[0], out_channels, *x.shape[2:], dtype=x.dtype, device=x.device), x, w)
    return node


def test_a_convolution_backward_holds_its_reordered_gradient_input_and_weight():
    node = _conv_backward_node(torch.randn(2, 8, 6, 6), 16)
    assert workspace_bytes(node, "cpu") == (2 * 16 * 36 + 2 * 8 * 36 + 16 * 8 * 9) * FLOAT
    slow = _conv_backward_node(torch.randn(1, 8, 6, 6), 16)  # the slow path: its columns again
    assert workspace_bytes(slow, "cpu") == 8 * 9 * 36 * FLOAT


HALF = 2


def test_a_half_nchw_convolution_on_a_gpu_holds_nhwc_copies_of_input_weight_and_output():
    """cuDNN's tensor-core kernels run NHWC: an NCHW half convolution holds copies of its
    input, weight and output (an H200's allocator: VGG-19 bs8 conv1_2, 98 MiB beside its 50 MiB
    output). Not where a channel count is no multiple of 8 (an RGB stem), not channels_last
    tensors, not a 1x1 stride-1 convolution over 14x14 positions or more (a GEMM as it is)."""
    half = dict(dtype=torch.float16, device="meta")
    conv = _conv_node(torch.empty(2, 8, 6, 6, **half), 16)
    assert workspace_bytes(conv, "cuda") == (2 * 8 * 36 + 16 * 8 * 9 + 2 * 16 * 36) * HALF
    assert workspace_bytes(_conv_node(torch.empty(2, 3, 6, 6, **half), 16), "cuda") == 0
    channels_last = torch.empty(2, 8, 6, 6, **half).to(memory_format=torch.channels_last)
    assert workspace_bytes(_conv_node(channels_last, 16), "cuda") == 0
    assert workspace_bytes(_conv_node(torch.empty(2, 8, 14, 14, **half), 16, kernel=1), "cuda") == 0
    small_1x1 = _conv_node(torch.empty(2, 8, 7, 7, **half), 16, kernel=1)
    assert workspace_bytes(small_1x1, "cuda") == (2 * 8 * 49 + 16 * 8 + 2 * 16 * 49) * HALF
    backward = _conv_backward_node(torch.empty(2, 8, 6, 6, **half), 16)
    assert workspace_bytes(backward, "cuda") == (2 * 16 * 36 + 2 * 8 * 36 + 16 * 8 * 9) * HALF
    assert workspace_bytes(_conv_node(torch.empty(2, 8, 6, 6, device="meta"), 16), "cuda") == 0  # float32


def test_a_half_conv_nets_predicted_gpu_peak_holds_its_largest_convolutions_copies():
    """VGG-style: the first 64-channel convolution at full resolution holds its input's, its
    weight's and its output's NHWC copies beside the output (an H200 measured VGG-19 fp16 bs8
    inference at 198 MiB above its weights, predicted 196)."""
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU(),
                                    torch.nn.Conv2d(64, 64, 3, padding=1)).half().eval()
    x = torch.empty(2, 3, 32, 32, dtype=torch.float16, device="meta")
    prediction = fxdream.simulate(model, (x,), device="h200", cost="analytic")
    activation = 2 * 64 * 32 * 32 * HALF
    weight = 64 * 64 * 9 * HALF
    # the relu's output (the second conv's input) + the conv's output + its three copies
    expected = activation + activation + (activation + weight + activation)
    assert prediction.peak_memory_bytes - prediction.static_bytes == expected
