"""A prediction for a device that is not here (analytic costs) never runs the model on real data:
it captures a copy on the meta device. Models and inputs already on the meta device are taken."""
import collections

import pytest
import torch
import torch.nn as nn

import fxdream
from fxdream.build import cost_model_for
from fxdream.capturing.meta import meta_copy, on_meta
from fxdream.sim.optimizer_step import SGD
from fxdream.sim.prediction import predict


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.fc = nn.Linear(8, 10)
        self.devices = []
        self.conv.register_forward_hook(lambda m, inputs, out: self.devices.append(inputs[0].device.type))

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).mean((2, 3)))


def test_a_prediction_for_another_device_runs_nothing_on_real_data_and_leaves_the_model_alone():
    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(4, 3, 16, 16)
    weight = model.conv.weight.detach().clone()
    devices = []  # outside the model: a prediction gives the model's own attributes back as they were
    model.conv.register_forward_hook(lambda m, inputs, out: devices.append(inputs[0].device.type))
    prediction = fxdream.simulate(model, (x,), device="h100", training=True)
    assert prediction.time_ms > 0 and prediction.device.name == "h100"
    # every forward that ran (the copy's hooks append to this list too) saw meta tensors, no data
    assert devices and set(devices) == {"meta"} and model.devices == []
    assert model.conv.weight.device.type == "cpu" and torch.equal(model.conv.weight, weight)
    assert model.conv.weight.grad is None and model.bn.num_batches_tracked.item() == 0


def test_meta_capture_predicts_what_a_capture_on_real_data_predicts():
    torch.manual_seed(0)
    model, x = Net().train(), torch.randn(4, 3, 16, 16)
    on_real = predict(fxdream.capture(model, (x,), training=True), cost_model_for("h100", "analytic"), True, SGD)
    meta_model, meta_inputs, _ = meta_copy(model, (x,))
    assert on_meta(meta_model) and not on_meta(model)
    on_fake = fxdream.simulate(meta_model, meta_inputs, device="h100", training=True, optimizer="sgd")
    assert on_fake.time_ms == pytest.approx(on_real.time_ms)
    assert on_fake.peak_memory_bytes == on_real.peak_memory_bytes


def test_a_model_built_on_the_meta_device_is_predicted_and_not_profiled():
    with torch.device("meta"):
        model, x = Net().train(), torch.randn(4, 3, 16, 16)
    assert fxdream.simulate(model, (x,), device="cpu", training=True).time_ms > 0  # auto: analytic
    with pytest.raises(ValueError, match="cost='profiled' measures the model on this machine, and its tensors are "
                                         "on the meta device"):
        fxdream.simulate(model, (x,), device="cpu", cost="profiled")


class ReadsAValue(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return y * 2 if y.sum().item() > 0 else y


def test_a_model_that_reads_tensor_values_is_captured_on_its_data_and_the_prediction_says_why():
    prediction = fxdream.simulate(ReadsAValue(), (torch.randn(2, 4),), device="h100")
    assert prediction.time_ms > 0
    assert prediction.notes[0].startswith("captured on the example's data here, not on the meta device, where its "
                                          "capture failed (RuntimeError: Tensor.item() cannot be called on meta")
    # the branch taken is the example's: the note says the prediction holds for that path
    assert prediction.notes[0].endswith("the prediction follows the path (branches, sizes) the example's values "
                                        "took: other inputs may take another")


def test_the_predicted_peak_is_said_to_fit_or_not_in_the_devices_memory():
    from fxdream.sim.cost import get_device
    from fxdream.sim.prediction import Prediction
    timeline = type("Timeline", (), {"peak_memory_bytes": 81 * 2**30, "makespan_us": 1.0})()
    v100, h200 = (Prediction(get_device(name), True, None, timeline, 0) for name in ("v100", "h200"))
    assert not v100.fits_in_memory and v100.memory_verdict() == "does not fit in v100 memory (32 GiB)"
    assert h200.fits_in_memory and h200.memory_verdict() == "fits in h200 memory (141 GiB)"


@pytest.mark.skipif(torch.cuda.is_available(), reason="autocast('cuda') runs where CUDA is")
def test_a_disabled_autocast_region_is_named_in_the_prediction():
    class AutocastInside(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x):
            with torch.autocast("cuda", dtype=torch.float16):
                return self.linear(x)
    with pytest.warns(UserWarning, match="Disabling autocast"):
        prediction = fxdream.simulate(AutocastInside(), (torch.randn(2, 4),), device="h100")
    assert any("torch.autocast for a device this machine does not have" in n for n in prediction.notes)
    plain = fxdream.simulate(torch.nn.Linear(4, 4), (torch.randn(2, 4),), device="h100")
    assert not any("autocast" in n for n in plain.notes)


def test_a_meta_hugging_face_model_with_its_cache_on_is_predicted_with_it():
    """transformers makes its KV cache with torch.tensor([]) on the model's device, a real meta
    tensor in dynamo's trace (``traceable_on_meta``): predicted with the cache as without it
    (its first step concatenates keys and values to empty tensors, at most a copy each)."""
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, vocab_size=50)
        model = transformers.LlamaForCausalLM(config)
    ids = torch.zeros(2, 8, dtype=torch.long, device="meta")
    for training in (False, True):
        kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
        cached = fxdream.simulate(model, device="h100", training=training, example_kwargs=kwargs)
        uncached = fxdream.simulate(model, device="h100", training=training,
                                    example_kwargs={**kwargs, "use_cache": False})
        assert 0 < uncached.time_ms <= cached.time_ms and len(uncached.task_graph) <= len(cached.task_graph)


class MakesMetaConstants(nn.Module):
    """Tensors made inside forward from Python values: an empty one, an index list, a scalar."""
    def forward(self, x):
        flat = torch.cat([torch.tensor([], device=x.device), x.flatten()])
        return flat, x[..., [-2]], torch.where(x > 0, x, torch.tensor(-1.0, device=x.device))


def test_tensors_a_meta_model_makes_from_python_values_are_traced():
    with torch.device("meta"):
        model, x = MakesMetaConstants(), torch.randn(2, 4)
    captured = fxdream.capture(model, (x,))
    out = next(n for n in captured.forward.graph.nodes if n.op == "output")
    shapes = [tuple(a.meta["val"].shape) for a in out.args[0]]
    assert shapes == [(8,), (2, 1), (2, 4)]
    assert fxdream.simulate(model, (x,), device="h100").time_ms > 0


def test_a_meta_model_reading_a_value_gets_a_capture_error_saying_what_to_do():
    with torch.device("meta"):
        model = ReadsAValue()
    with pytest.raises(fxdream.CaptureError, match="reads a tensor's value .* build the model on the CPU"):
        fxdream.simulate(model, (torch.randn(2, 4, device="meta"),), device="h100")


@pytest.mark.parametrize("on_meta_device", [False, True])
def test_operands_of_two_dtypes_eager_refuses_are_refused_on_the_meta_device_too(on_meta_device):
    device = "meta" if on_meta_device else "cpu"
    with torch.device(device):
        model = nn.Sequential(nn.Linear(8, 4), nn.ReLU())
        x = torch.ones(2, 8, dtype=torch.long)
    with pytest.raises(fxdream.CaptureError, match=r"addmm in 0 takes float32 and int64 operands, which eager refuses"):
        fxdream.simulate(model, (x,), device="h100")


def test_a_lazy_module_not_yet_called_is_named_with_what_to_do_before_a_prediction_for_another_device():
    model = nn.Sequential(nn.Linear(4, 4), nn.LazyLinear(8))
    with pytest.raises(ValueError, match=r"lazy module 1 \(LazyLinear\) not yet called: .* call the model once"):
        fxdream.simulate(model, (torch.randn(2, 4),), device="h100")
    model(torch.randn(2, 4))
    assert fxdream.simulate(model, (torch.randn(2, 4),), device="h100").time_ms > 0


@pytest.mark.parametrize("model_on, inputs_on, message", [
    ("meta", "cpu", r"the model is on the meta device and an example input is on cpu \(shape \(2, 4\)\): make the "
                    r"inputs on the meta device too"),
    ("cpu", "meta", r"an example input is on the meta device and the model's weights are on cpu: build the model"),
])
def test_a_model_and_inputs_on_either_side_of_the_meta_device_get_one_line(model_on, inputs_on, message):
    with torch.device(model_on):
        model = nn.Linear(4, 4)
    with pytest.raises(ValueError, match=message):
        fxdream.simulate(model, (torch.randn(2, 4, device=inputs_on),), device="h100")


def test_lengths_stay_on_the_cpu_beside_a_meta_model():
    """pack_padded_sequence takes its lengths on the CPU: an integer input there is no mix-up."""
    from fxdream.capturing.meta import check_meta_on_both_sides
    with torch.device("meta"):
        model = nn.LSTM(4, 8)
    check_meta_on_both_sides(model, (torch.randn(5, 2, 4, device="meta"), torch.tensor([5, 3])))


@pytest.mark.parametrize("call, error, message", [
    (lambda: fxdream.simulate(lambda x: x * 2, (torch.randn(2),), device="h100"), TypeError,
     "model must be a torch.nn.Module, got function"),
    (lambda: fxdream.simulate(nn.Linear(2, 2), (torch.randn(1, 2),), device="h100", memory_budget=-1), ValueError,
     "memory_budget must be None or a number of bytes ≥ 0"),
])
def test_a_bad_model_or_memory_budget_gets_one_line(call, error, message):
    with pytest.raises(error, match=message):
        call()


class MaskedSum(nn.Module):
    """Boolean-mask indexing: nonzero, whose result size depends on the mask's values."""
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 1)

    def forward(self, x, mask):
        return self.fc(x).squeeze(-1)[mask == 1].sum()


def test_a_meta_model_indexing_with_a_mask_is_predicted_keeping_every_element():
    """Built on the meta device there is no mask to count: nonzero keeps every element (an upper
    bound, said in a note), which for an all-ones mask is what the data gives."""
    x, mask = torch.randn(2, 12, 8), torch.ones(2, 12, dtype=torch.long)
    torch.manual_seed(0)
    on_data = fxdream.simulate(MaskedSum().train(), (x, mask), device="h100", training=True)
    with torch.device("meta"):
        model = MaskedSum().train()
    on_meta_device = fxdream.simulate(model, (x.to("meta"), mask.to("meta")), device="h100", training=True)
    assert on_meta_device.time_ms == pytest.approx(on_data.time_ms)
    assert on_meta_device.notes[0].startswith("nonzero (boolean-mask indexing) on the meta device keeps every element")
    assert not any("keeps every element" in note for note in on_data.notes)  # captured on its data


@pytest.mark.parametrize("training", [False, True])
def test_optimize_of_a_meta_model_captures_without_passes_or_timing_and_says_so(training):
    with torch.device("meta"):
        model = Net().train(training)
    x = torch.randn(4, 3, 16, 16, device="meta")
    built = fxdream.optimize(model, (x,), passes="auto", training=training)
    report = built.report
    assert report.graphs and not report.passes and report.predicted_optimized_ms is None
    assert report.measured_eager_ms is None and "on the meta device" in report.notes[0]
    assert built(x).shape == model(x).shape


def test_a_training_lstm_on_the_meta_device_is_one_op_with_its_backward_and_twice_its_flops():
    """On the meta device an LSTM in training is kept whole with its backward, as cuDNN and oneDNN
    run it, instead of a graph break whose eager code no prediction there could time."""
    from collections import Counter

    from fxdream.ir.flops import node_flops
    with torch.device("meta"):
        model = torch.nn.Sequential()
        model.rnn = torch.nn.LSTM(8, 16, num_layers=2, batch_first=True)
        x = torch.empty(4, 10, 8)

    class Head(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn, self.out = model.rnn, torch.nn.Linear(16, 3, device="meta")

        def forward(self, x):
            return self.out(self.rnn(x)[0])
    prediction = fxdream.simulate(Head(), (x,), device="h100", training=True)
    ops = Counter(t.op for t in prediction.task_graph.tasks if t.resource.startswith("stream"))  # kernels
    assert ops["fxdream.lstm_train"] == 1 and ops["fxdream.lstm_train_backward"] == 1 and not ops["aten.sigmoid"]
    assert not any(n.startswith("not in this prediction") for n in prediction.notes)
    assert prediction.outside_state_bytes == 0  # its weights are graph inputs, updated by the optimizer
    captured = fxdream.capture(Head(), (x,), training=True)
    fw, bw = (next(n for n in gm.graph.nodes if str(n.target).startswith(op))
              for gm, op in ((captured.forward, "fxdream.lstm_train"), (captured.backward, "fxdream.lstm_train_back")))
    # every weight matrix times every one of the 40 tokens: (64x8 + 64x16) + (64x16 + 64x16), 2 FLOPs each
    assert node_flops(fw) == 2 * 40 * (64 * 8 + 3 * 64 * 16) and node_flops(bw) == 2 * node_flops(fw)


class _Recurrent(nn.Module):
    def __init__(self, rnn: nn.Module):
        super().__init__()
        self.rnn, self.out = rnn, nn.Linear(rnn.hidden_size * (2 if rnn.bidirectional else 1), 3)

    def forward(self, x):
        return self.out(self.rnn(x)[0])


@pytest.mark.parametrize("kind", ["GRU", "RNN"])
def test_a_training_gru_or_rnn_on_the_meta_device_is_one_op_with_its_backward(kind):
    """As an LSTM: without it, dynamo broke the graph at the RNN and the prediction left the
    RNN out, forward and backward (a note said so)."""
    from fxdream.ir.flops import node_flops
    with torch.device("meta"):
        model = _Recurrent(getattr(nn, kind)(8, 16, num_layers=2, bidirectional=True))
        x = torch.empty(10, 4, 8)
    prediction = fxdream.simulate(model, (x,), device="h100", training=True)
    ops = collections.Counter(t.op for t in prediction.task_graph.tasks if t.resource.startswith("stream"))
    assert ops["fxdream.rnn_train"] == 1 and ops["fxdream.rnn_train_backward"] == 1
    assert not any(n.startswith("not in this prediction") for n in prediction.notes)
    captured = fxdream.capture(model, (x,), training=True)
    fw, bw = (next(n for n in gm.graph.nodes if str(n.target).startswith(op))
              for gm, op in ((captured.forward, "fxdream.rnn_train"), (captured.backward, "fxdream.rnn_train_back")))
    gates = 3 if kind == "GRU" else 1
    # layer 1: input 8 and hidden 16 per direction; layer 2: input 32 (both directions) and hidden 16
    per_token = 2 * (gates * 16 * 8 + gates * 16 * 16) + 2 * (gates * 16 * 32 + gates * 16 * 16)
    assert node_flops(fw) == 2 * 40 * per_token and node_flops(bw) == 2 * node_flops(fw)
    reserve = fw.meta["val"][2]  # what the backward reads: per layer, direction and step, the gates
    assert tuple(reserve.shape) == (4, 10, 4, (4 if kind == "GRU" else 1) * 16)


def test_an_rnn_in_eval_inside_a_training_step_on_meta_passes_its_gradients():
    """A frozen RNN (eval, its parameters still trained or its input's gradient needed) is kept
    whole with its backward: the inference op has no gradient formula."""
    with torch.device("meta"):
        model = _Recurrent(nn.LSTM(8, 16))
        x = torch.empty(10, 4, 8)
    model.rnn.eval()
    captured = fxdream.capture(model, (x,), training=True)
    assert any(str(n.target).startswith("fxdream.lstm_train_backward") for n in captured.backward.graph.nodes)


class _Circular(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1, padding_mode="circular")

    def forward(self, x):
        return self.conv(x)


class _Upsample(nn.Module):
    def forward(self, x):
        return nn.functional.interpolate(x, scale_factor=2, mode="bilinear")


class _MaxPool1d(nn.Module):
    def forward(self, x):
        return nn.functional.max_pool1d(x.flatten(2), 2)


class _Cell(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.GRUCell(8, 8)

    def forward(self, x):
        return self.cell(x[:, 0, 0, :8])


class _Gru(nn.Module):
    def __init__(self):
        super().__init__()
        self.gru = nn.GRU(8, 8, batch_first=True)

    def forward(self, x):
        return self.gru(x[:, 0, :, :8])[0]


@pytest.mark.parametrize("make", [_Circular, _Upsample, _MaxPool1d, _Cell, _Gru], ids=lambda m: m.__name__)
def test_a_meta_model_in_inference_keeps_its_whole_ops_whole(make):
    """autocast has no mode for the meta device (asking raises there): the ops fxdream keeps whole
    are kept whole on it, as on a CPU."""
    with torch.device("meta"):
        model, x = make().eval(), torch.randn(2, 3, 8, 8)
    prediction = fxdream.simulate(model, (x,), device="h100")
    ops = {task.op for task in prediction.task_graph.tasks}
    assert prediction.time_ms > 0 and any(op.startswith("fxdream") for op in ops), ops


def test_a_packed_sequence_keeps_its_batch_sizes_on_the_cpu_in_a_meta_copy():
    """torch requires a PackedSequence's ``batch_sizes`` on the CPU; its data and indices go to meta."""
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(2, 5, 6), torch.tensor([5, 3]), batch_first=True,
                                               enforce_sorted=False)
    _, (copy,), _ = meta_copy(nn.Linear(1, 1), (packed,))
    assert isinstance(copy, nn.utils.rnn.PackedSequence) and copy.data.device.type == "meta"
    assert copy.batch_sizes.device.type == "cpu" and torch.equal(copy.batch_sizes, packed.batch_sizes)
    assert copy.sorted_indices.device.type == "meta" and copy.data.shape == packed.data.shape


class _PackedLstm(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm, self.fc = nn.LSTM(6, 8, batch_first=True), nn.Linear(8, 2)

    def forward(self, packed):
        _, (h, _) = self.lstm(packed)
        return self.fc(h[-1])


def test_a_model_given_a_packed_sequence_is_predicted_for_another_device():
    packed = nn.utils.rnn.pack_padded_sequence(torch.randn(2, 5, 6), torch.tensor([5, 3]), batch_first=True)
    prediction = fxdream.simulate(_PackedLstm(), (packed,), device="h100")
    assert prediction.time_ms > 0


class ClassifierWithLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 5)

    def forward(self, x, target):
        return nn.functional.cross_entropy(nn.functional.relu6(self.fc(x)), target)


def test_a_meta_training_capture_has_the_backward_of_ops_torch_gives_python_meta_kernels(recwarn):
    """nll_loss and relu6 decompose for autograd and have Python meta kernels, which a meta trace
    prefers: their backward (and the linear layer's before them) was missing, with torch's
    "autograd kernel was not registered" warning. Captured on meta, the backward is the CPU one."""
    graphs = {}
    for device in ("cpu", "meta"):
        with torch.device(device):
            model, x, target = ClassifierWithLoss(), torch.randn(4, 8), torch.zeros(4, dtype=torch.long)
        captured = fxdream.capture(model, (x, target), training=True)
        graphs[device] = [str(n.target) for n in captured.backward.graph.nodes if n.op == "call_function"]
    assert "aten.nll_loss_backward.default" in graphs["meta"] and "aten.hardtanh_backward.default" in graphs["meta"]
    assert sorted(graphs["meta"]) == sorted(graphs["cpu"])
    assert not [w for w in recwarn if "autograd kernel was not registered" in str(w.message)]
    assert torch.ops.aten.nll_loss.default.py_kernels  # the kernels set aside are back


def test_an_input_given_twice_stays_one_tensor_in_a_meta_copy():
    x = torch.randn(2, 3)
    _, (a, b), _ = meta_copy(nn.Linear(1, 1), (x, x))
    assert a is b and a.device.type == "meta"


class MaskedAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(16, 48)

    def forward(self, x, mask):
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
        return nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def _attention_ops(captured, phase):
    return collections.Counter(str(n.target) for n in getattr(captured, phase).graph.nodes
                               if n.op == "call_function" and any(w in str(n.target) for w in ("attention", "bmm",
                                                                                               "softmax")))


@pytest.mark.parametrize("make", [
    lambda: (MaskedAttention(), (torch.randn(2, 5, 16), torch.rand(2, 1, 5, 5) > 0.3)),
    lambda: (nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), (torch.randn(2, 5, 16),)),
], ids=["sdpa_with_a_bool_mask", "transformer_encoder_layer"])
@pytest.mark.parametrize("training", [False, True])
def test_attention_on_the_meta_device_is_the_fused_kernel_with_its_backward(make, training):
    """torch registers no fused SDPA kernel choice for meta tensors, so it traces the math path
    there (the whole attention matrix, saved for the backward); a GPU runs a fused kernel."""
    with torch.device("meta"):
        model, inputs = make()
    captured = fxdream.capture(model.train(training), inputs, training=training)
    assert _attention_ops(captured, "forward") == {"aten._scaled_dot_product_efficient_attention.default": 1}
    if training:
        assert _attention_ops(captured, "backward") == {
            "aten._scaled_dot_product_efficient_attention_backward.default": 1}
    assert fxdream.simulate(model, inputs, device="h100", training=training).time_ms > 0


def test_the_cpu_attention_backward_has_its_flops():
    from fxdream.ir.flops import node_flops
    model, x = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), torch.randn(2, 5, 16)
    captured = fxdream.capture(model, (x,), training=True)
    (backward,) = [n for n in captured.backward.graph.nodes if "flash_attention_for_cpu_backward" in str(n.target)]
    assert node_flops(backward) == 5 * 2 * (2 * 2) * 5 * 5 * 8  # q·kᵀ again and four products, 2·b·h·s·t·d each


class _MaskedTransformer(nn.Module):
    """nn.Transformer as its documentation shows it: a causal target mask, no ``tgt_is_causal``."""
    def __init__(self):
        super().__init__()
        self.t = nn.Transformer(32, 4, 1, 1, 64, dropout=0.0, batch_first=True)

    def forward(self, src, tgt):
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1], device=tgt.device)
        return self.t(src, tgt, tgt_mask=mask)


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_a_transformer_given_a_mask_is_predicted_whole_and_the_note_says_how(training):
    """torch reads the mask's values to tell whether it is causal; dynamo breaks the graph there,
    inside torch's code, and ran the whole nn.Transformer eagerly: a prediction for another device
    held no attention at all. The capture for a prediction takes the mask as given."""
    from fxdream.capturing.causal_mask import causal_checks_unread
    model, src, tgt = _MaskedTransformer(), torch.randn(2, 6, 32), torch.randn(2, 5, 32)
    prediction = fxdream.simulate(model, (src, tgt), device="h100", training=training)
    ops = collections.Counter(t.op for t in prediction.task_graph.tasks if t.resource.startswith("stream"))
    assert ops["aten._scaled_dot_product_efficient_attention"] == 3  # encoder, decoder self and cross attention
    assert not any(n.startswith("not in this prediction") for n in prediction.notes)
    assert any(n.startswith("the masks given to nn.TransformerEncoder/Decoder were taken as not causal")
               for n in prediction.notes)
    original = torch.nn.modules.transformer._detect_is_causal_mask
    with causal_checks_unread() as checks:
        assert torch.nn.modules.transformer._detect_is_causal_mask(torch.zeros(2, 2), True) is True  # kept
    assert checks.answered == 0 and torch.nn.modules.transformer._detect_is_causal_mask is original


def test_a_module_built_from_a_masked_transformer_keeps_torchs_check_and_equals_eager():
    model, src, tgt = _MaskedTransformer().eval(), torch.randn(2, 6, 32), torch.randn(2, 5, 32)
    optimized = fxdream.optimize(model, (src, tgt), eager_check=False)
    with torch.no_grad():
        torch.testing.assert_close(optimized(src, tgt), model(src, tgt))


def test_a_torchscript_submodule_is_predicted_around_and_a_torchscript_model_is_refused_clearly():
    class WithScript(nn.Module):
        def __init__(self):
            super().__init__()
            self.pre, self.inner, self.post = nn.Linear(16, 16), torch.jit.script(nn.Linear(16, 16)), nn.Linear(16, 4)

        def forward(self, x):
            return self.post(self.inner(self.pre(x)))

    model, x = WithScript(), torch.randn(4, 16)
    assert fxdream.simulate(model, (x,), device="h100").time_ms > 0
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in (model.pre, model.post))
    with pytest.raises(fxdream.CaptureError, match="TorchScript module .* the original nn.Module"):
        fxdream.simulate(torch.jit.script(nn.Linear(16, 4)), (x,), device="h100")


class _ValueSizedOps(nn.Module):
    def __init__(self, op):
        super().__init__()
        self.op = op

    def forward(self, x, counts):
        return self.op(x, counts)


@pytest.mark.parametrize("op, says", [
    (lambda x, counts: torch.repeat_interleave(x, counts, dim=0), "reads a tensor's value"),
    (lambda x, counts: torch.bincount(counts), "no meta kernel, as ops whose output size follows values")])
def test_ops_whose_output_size_follows_values_get_a_capture_error_saying_what_to_do(op, says):
    x, counts = torch.empty(4, 3, device="meta"), torch.empty(4, dtype=torch.long, device="meta")
    with pytest.raises(fxdream.CaptureError, match=says + ".* build the model on the CPU"):
        fxdream.simulate(_ValueSizedOps(op), (x, counts), device="h100")


def test_what_a_prediction_does_not_do_about_precision_is_said():
    from fxdream import whatif
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    x = torch.empty(16, 64, device="meta")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = fxdream.simulate(model, (x,), device="h100")
    assert any("inside torch.autocast('cpu')" in n for n in under.notes)
    assert not any("autocast" in n for n in fxdream.simulate(model, (x,), device="h100").notes)
    bf16 = fxdream.simulate(model.to(torch.bfloat16), (x.to(torch.bfloat16),), device="v100")
    assert any("v100 has no bfloat16 math" in n for n in bf16.notes)
    with pytest.raises(ValueError, match="v100 has no bfloat16 math"):
        whatif.amp(fxdream.simulate(model.float(), (x,), device="v100"), "v100", dtype="bfloat16")


def test_a_training_prediction_of_a_model_with_nothing_to_train_says_so():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
    for p in model.parameters():
        p.requires_grad_(False)
    prediction = fxdream.simulate(model, (torch.randn(2, 8),), device="h100", training=True)
    assert any("no parameter of the model requires grad" in n for n in prediction.notes)
