"""RNN cells stay one op in inference graphs (fxdream.rnn_cell_op), bit-equal to eager."""
import pytest
import torch
import torch.nn as nn

import fxdream
from fxdream.ops.rnn_cell import rnn_cell_inference


class Decoder(nn.Module):
    """A cell stepped in a loop, as seq2seq decoders do."""

    def __init__(self, kind: str, bias: bool = True):
        super().__init__()
        cells = {"gru": nn.GRUCell, "lstm": nn.LSTMCell, "tanh": nn.RNNCell,
                 "relu": lambda i, h, bias: nn.RNNCell(i, h, bias=bias, nonlinearity="relu")}
        self.cell, self.kind, self.out = cells[kind](6, 8, bias=bias), kind, nn.Linear(8, 6)

    def forward(self, x):
        state = None
        outputs = []
        for step in range(3):
            state = self.cell(x[:, step], state)
            h = state[0] if self.kind == "lstm" else state
            outputs.append(self.out(h))
        return torch.stack(outputs, 1), state


class DecoderWithKwargs(Decoder):
    """**kwargs keep torch.fx off: the dynamo path."""
    def forward(self, x, **unused):
        return super().forward(x)


def _targets(optimized):
    return [n.target for c in optimized.captured for n in c.forward.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("kind", ["gru", "lstm", "tanh", "relu"])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("cls", [Decoder, DecoderWithKwargs], ids=["torch.fx", "dynamo"])
def test_a_cell_is_one_op_per_step_in_inference_and_bit_equal_to_eager(kind, bias, cls):
    torch.manual_seed(0)
    model, x = cls(kind, bias).eval(), torch.randn(4, 3, 6)
    with torch.no_grad():
        expected = model(x)
    optimized = fxdream.optimize(model, (x,), cost=None)
    assert optimized.report.fallback_reason is None and not optimized.report.graph_breaks
    assert _targets(optimized).count(rnn_cell_inference) == 3
    actual = optimized(x)
    leaves = torch.utils._pytree.tree_leaves
    assert torch.utils._pytree.tree_structure(actual) == torch.utils._pytree.tree_structure(expected)
    assert all(torch.equal(a, e) for a, e in zip(leaves(actual), leaves(expected)))


def test_training_keeps_torchs_differentiable_ops():
    torch.manual_seed(0)
    model, x = Decoder("lstm"), torch.randn(4, 3, 6)
    optimized = fxdream.optimize(model, (x,), training=True, cost=None)
    assert rnn_cell_inference not in _targets(optimized)
    optimized(x)[0].sum().backward()
    assert model.cell.weight_ih.grad is not None


def test_the_op_passes_opcheck():
    x, h, c = torch.randn(4, 6), torch.randn(4, 8), torch.randn(4, 8)
    w_ih, w_hh, b = torch.randn(32, 6), torch.randn(32, 8), torch.randn(32)
    torch.library.opcheck(rnn_cell_inference, (x, [h, c], w_ih, w_hh, b, b, "lstm_cell"),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(rnn_cell_inference, (x, [h], w_ih[:24], w_hh[:24], None, None, "gru_cell"),
                          test_utils=("test_schema", "test_faketensor"))


@pytest.mark.parametrize("kind, gates", [("lstm", 4), ("gru", 3), ("tanh", 1)])
def test_a_cells_flops_are_its_two_weight_matrices_over_its_batch(kind, gates):
    # its state (hx, batch × hidden) is 2-d like a weight and is not one
    from fxdream.ir.flops import node_flops
    captured = fxdream.capture(Decoder(kind).eval(), (torch.randn(5, 3, 6),))
    cells = [n for n in captured.forward.graph.nodes if n.target is rnn_cell_inference]
    assert len(cells) == 3 and all(node_flops(n) == 2 * 5 * (gates * 8 * 6 + gates * 8 * 8) for n in cells)


@pytest.mark.parametrize("kind, bias", [("lstm", True), ("gru", True), ("gru", False)])
def test_a_trained_cell_is_predicted_for_a_gpu_as_a_gpu_runs_it(kind, bias):
    """On a GPU, ATen runs an LSTM or GRU cell as its two gate products and one fused kernel
    (forward and backward); on a CPU as ~10 pointwise ops forward and ~15 backward. A capture on
    the meta device for a GPU takes the GPU's ops, one for a CPU the CPU's. (An LSTM cell without
    biases stays split: torch's meta kernel of the fused cell needs them.)"""
    torch.manual_seed(0)
    x = torch.randn(4, 3, 6)
    fused = {"lstm": "aten._thnn_fused_lstm_cell", "gru": "aten._thnn_fused_gru_cell"}[kind]
    backward = {"lstm": "aten._thnn_fused_lstm_cell_backward_impl", "gru": "aten._thnn_fused_gru_cell_backward"}[kind]

    def ops(device, kind_of_task):  # a GPU's kernels; a CPU's tasks
        prediction = fxdream.simulate(Decoder(kind, bias), (x,), device=device, cost="analytic", training=True)
        return [t.op for t in prediction.task_graph.tasks if t.kind.value == kind_of_task], prediction
    on_gpu, gpu_prediction = ops("h100", "gpu")
    assert on_gpu.count(fused) == 3 and on_gpu.count(backward) == 3  # one per step
    assert not {"aten.sigmoid", "aten.tanh", "aten.sigmoid_backward", "aten.tanh_backward"} & set(on_gpu)
    on_cpu, _ = ops("cpu", "cpu")
    assert fused not in on_cpu and "aten.sigmoid" in on_cpu
    assert gpu_prediction.peak_memory_bytes > 0
