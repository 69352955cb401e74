"""Eager code between compiled graphs, recorded and costed in a prediction that measures nothing."""
import pytest
import torch
import torch.nn as nn

import fxdream
from fxdream.capturing.eager_ops import eager_ops, profiled
from fxdream.whatif.gradients import outside_gradients


def _norm_and_project(h, w):
    return nn.functional.linear(nn.functional.layer_norm(h * 2 + 1, (h.shape[-1],)), w)


_skipped_by_dynamo = torch.compiler.disable(_norm_and_project)


class _WithEagerPart(nn.Module):
    """A linear and a batch norm, then ``_norm_and_project`` (run eagerly where ``eager``), then a
    classifier."""

    def __init__(self, eager: bool, width: int = 256):
        super().__init__()
        self.first, self.last = nn.Linear(width, width), nn.Linear(width, 8)
        self.norm = nn.BatchNorm1d(width)  # buffers: state fxdream keeps around a step it runs
        self.w = nn.Parameter(torch.randn(width, width))
        self.middle = _skipped_by_dynamo if eager else _norm_and_project

    def forward(self, x):
        return self.last(self.middle(torch.relu(self.norm(self.first(x))), self.w)).softmax(-1)


def test_eager_ops_between_graphs_are_costed_as_the_same_ops_in_a_graph():
    torch.manual_seed(0)
    x = torch.randn(16, 256)
    eager = fxdream.simulate(_WithEagerPart(eager=True), (x,), device="h100")
    compiled = fxdream.simulate(_WithEagerPart(eager=False), (x,), device="h100")
    names = [t.name for t in eager.task_graph.tasks]
    # before the second graph call: mul, add, layer_norm (as native_layer_norm), linear (as t, mm)
    assert [n.split(":")[1] for n in names if n.startswith("eager1.fw:") and not n.endswith(":k")] == [
        "mul", "add", "native_layer_norm", "getitem", "getitem_1", "getitem_2", "t", "mm"]
    # the same ops, costed alike; the break adds the second graph's call, and nothing else
    graph_call_us = next(t.duration_us for t in eager.task_graph.tasks if t.name == "g1.fw:call")
    assert eager.time_ms == pytest.approx(compiled.time_ms + graph_call_us / 1e3, rel=1e-6)
    assert "the eager code where the graph broke" in eager.notes[0] and "5 ATen ops" in eager.notes[0]


def test_eager_backward_ops_are_costed_in_training():
    torch.manual_seed(0)
    x = torch.randn(16, 256)
    prediction = fxdream.simulate(_WithEagerPart(eager=True), (x,), device="h100", training=True)
    backward_mms = [t.name for t in prediction.task_graph.tasks
                    if t.name.startswith("eager") and ".bw:mm" in t.name and not t.name.endswith(":k")]
    assert len(backward_mms) == 2  # the eager linear's gradients: input and weight
    # only the step's own ops: none of the state fxdream saves and restores around it (set_, copy_)
    (note,) = [n for n in prediction.notes if n.startswith("the eager code")]
    assert "not replayed" not in note and not any(t.name.startswith("eager0.") for t in prediction.task_graph.tasks)


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_the_optimizer_step_updates_parameters_only_eager_code_uses(optimizer):
    """``w`` is an input of no graph where the middle runs eagerly: it is updated all the same,
    as the same step captured whole updates it (and the fused what-if moves its state too)."""
    torch.manual_seed(0)
    x = torch.randn(16, 256)

    def optimizer_tasks(eager: bool):
        prediction = fxdream.simulate(_WithEagerPart(eager=eager), (x,), device="h100", training=True,
                                      optimizer=optimizer)
        tasks = [t for t in prediction.task_graph.tasks if t.phase == "optim"]
        return prediction, len(tasks), sum(t.duration_us for t in tasks)
    (eager, *eager_tasks), (captured, *captured_tasks) = optimizer_tasks(True), optimizer_tasks(False)
    assert eager_tasks == pytest.approx(captured_tasks, rel=1e-9) and eager_tasks[0] > 0
    assert eager.outside_gradient_bytes == 256 * 256 * 4 and captured.outside_gradient_bytes == 0
    fused = [fxdream.whatif.fused_optimizer(p, captured=c) for p, c in
             ((eager, fxdream.capture(_WithEagerPart(eager=True), (x,), training=True)),
              (captured, fxdream.capture(_WithEagerPart(eager=False), (x,), training=True)))]
    assert fused[0].details["fused.bytes"] == fused[1].details["fused.bytes"]


def test_data_parallel_steps_reduce_gradients_only_eager_code_makes():
    """DDP all-reduces ``w``'s gradient, and P3 sends it, whether the code using ``w`` runs
    eagerly or captured; its all-reduce starts once the backward has ended."""
    torch.manual_seed(0)
    x = torch.randn(16, 256)
    cluster = fxdream.whatif.Cluster(machines=2, gpus_per_machine=1, network_gbps=10)
    results = {}
    for eager in (True, False):
        model = _WithEagerPart(eager=eager)
        prediction = fxdream.simulate(model, (x,), device="h100", training=True, optimizer="sgd")
        captured = fxdream.capture(model, (x,), training=True)
        results[eager] = (fxdream.whatif.ddp(prediction, cluster, captured=captured),
                          fxdream.whatif.p3(prediction, cluster, captured=captured), prediction)
    (ddp_eager, p3_eager, eager_prediction), (ddp_captured, p3_captured, _) = results[True], results[False]
    assert eager_prediction.outside_gradients == (("w", 256 * 256 * 4),)
    assert ddp_eager.details["ddp.gradient_MB"] == pytest.approx(ddp_captured.details["ddp.gradient_MB"], rel=1e-9)
    assert ddp_eager.details["ddp.allreduce_ms_total"] > 0
    assert p3_eager.details["p3.allreduce_ms_total"] == pytest.approx(p3_captured.details["p3.allreduce_ms_total"],
                                                                       rel=1e-9)
    (outside,) = outside_gradients(eager_prediction.outside_gradients, eager_prediction.task_graph, 0)
    backward = eager_prediction.task_graph.select(phase="bw", kind="gpu")
    assert outside.producer == backward[-1] and outside.nbytes == 256 * 256 * 4


class _EagerHead(nn.Module):
    """A body dynamo captures, then a head it skips (``torch.compiler.disable``)."""

    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(32, 32), nn.Linear(32, 8)

    def forward(self, x):
        return self._head(self.body(x).relu())

    @torch.compiler.disable
    def _head(self, h):
        return self.head(h)


@pytest.mark.parametrize("training", [False, True])
def test_eager_ops_are_the_layers_of_the_modules_they_ran_in(training):
    """The head's forward ops, and in training the backward ops autograd's engine ran for them,
    are the head's layer, as they would be in a graph (``explain``'s per-layer table)."""
    torch.manual_seed(0)
    prediction = fxdream.simulate(_EagerHead().train(training), (torch.randn(16, 32),), device="h100",
                                  training=training)
    eager = [t for t in prediction.task_graph.tasks if t.name.startswith("eager") and not t.name.endswith(":k")]
    assert {t.phase for t in eager} == ({"fw", "bw"} if training else {"fw"})
    assert {t.layer for t in eager} == {"head"}
    assert "head" in dict(prediction.top_layers())


class _CopiesToHost(nn.Module):
    """Reads a tensor on the host between two linear layers, by ``.tolist()`` or ``.cpu()``
    (methods that run no ATen op of their own)."""

    def __init__(self, method: str):
        super().__init__()
        self.first, self.last, self.method = nn.Linear(32, 32), nn.Linear(32, 4), method

    def forward(self, x):
        h = self.first(x).relu()
        rows = len(getattr(_on_host, self.method)(h))
        return self.last(h) * rows


class _on_host:  # noqa: N801  (a namespace of the two reads)
    tolist = staticmethod(lambda h: h.amax(dim=1).tolist())
    cpu = staticmethod(torch.compiler.disable(lambda h: h.amax(dim=1).cpu()))


@pytest.mark.parametrize("method", ["tolist", "cpu"])
def test_a_copy_to_the_host_by_a_tensor_method_is_a_read_the_host_waits_for(method):
    """On a GPU ``.tolist()`` and ``.cpu()`` copy the tensor to the host and wait for it, as
    ``.item()`` does; the profiler records no op for either, so the recording marks them."""
    torch.manual_seed(0)
    prediction = fxdream.simulate(_CopiesToHost(method), (torch.randn(8, 32),), device="h100")
    syncs = [t for t in prediction.task_graph.tasks if t.kind.value == "sync"]
    assert len(syncs) == 1 and syncs[0].name.startswith("eager")
    read = prediction.task_graph.task(syncs[0].name.removesuffix(":sync"))
    assert read.op == "aten._local_scalar_dense"


def test_a_gradient_only_eager_code_makes_is_ready_when_its_modules_backward_ends():
    """The head runs eagerly: its gradients are all-reduced after the head's backward, before the
    body's backward (the captured graph's), not when the whole backward ends."""
    torch.manual_seed(0)
    model, x = _EagerHead().train(), torch.randn(16, 32)
    prediction = fxdream.simulate(model, (x,), device="h100", training=True)
    assert [name for name, _ in prediction.outside_gradients] == ["head.weight", "head.bias"]
    made = outside_gradients(prediction.outside_gradients, prediction.task_graph, 0)
    backward = prediction.task_graph.select(phase="bw", kind="gpu")
    for gradient in made:
        assert prediction.task_graph.task(gradient.producer).layer == "head"
        assert backward.index(gradient.producer) < len(backward) - 1  # the body's backward follows
    ddp = fxdream.whatif.ddp(prediction, fxdream.whatif.Cluster(2, 1), captured=fxdream.capture(model, (x,), True))
    assert ddp.details["ddp.gradient_MB"] * 1e6 == pytest.approx(sum(p.numel() * 4 for p in model.parameters()))


def test_indexing_with_tensors_is_replayed_as_a_copy_of_what_it_reads_or_writes():
    # the profiler records an index list of optional tensors with no shapes: the output's size is unknown
    a, values = torch.randn(4, 8, device="meta"), torch.randn(2, 8, device="meta")
    index = torch.zeros(2, dtype=torch.long, device="meta")
    with profiled() as events:
        torch.cat([a, values]).relu()
        a[index]
        a[index] = values
    before, skipped = eager_ops(events, calls=0)
    assert skipped == {}
    (((phase, graph),),) = before.values()  # a tensor list's shapes are recorded: cat is replayed
    assert phase == "fw"
    ops = [n for n in graph.graph.nodes if n.op == "call_function"]
    assert [n.target for n in ops] == [torch.ops.aten.cat.default, torch.ops.aten.relu.default,
                                       torch.ops.aten.clone.default, torch.ops.aten.clone.default]
    assert [tuple(x.meta["val"].shape) for x in ops[0].args[0]] == [(4, 8), (2, 8)]
    assert [tuple(n.args[0].meta["val"].shape) for n in ops[2:]] == [(4, 8), (2, 8)]  # the read, the write


def test_ops_that_cannot_be_replayed_are_named():
    values = torch.randint(0, 4, (16,))
    with profiled() as events:
        torch.bincount(values).relu()  # its output's size follows the values: no meta kernel
    before, skipped = eager_ops(events, calls=0)
    assert skipped == {"aten::bincount": 1}
    (((_, graph),),) = before.values()
    assert [n.target for n in graph.graph.nodes if n.op == "call_function"] == [torch.ops.aten.relu.default]


class _Recurrent(nn.Module):
    """An LSTM, run eagerly where ``eager`` (``torch.compiler.disable``), then a linear layer."""

    def __init__(self, eager: bool):
        super().__init__()
        self.lstm, self.fc = nn.LSTM(32, 64, batch_first=True), nn.Linear(64, 8)
        self.run_lstm = torch.compiler.disable(self.lstm) if eager else self.lstm

    def forward(self, x):
        return self.fc(self.run_lstm(x)[0])


def test_an_eager_rnn_layer_is_one_op_as_in_a_graph_not_its_per_step_ops():
    x = torch.randn(2, 16, 32)
    eager = fxdream.simulate(_Recurrent(eager=True), (x,), device="h100")
    compiled = fxdream.simulate(_Recurrent(eager=False), (x,), device="h100")
    assert eager.time_ms == pytest.approx(compiled.time_ms, rel=1e-6)  # on meta it would run ~30 ops per step
    trained = fxdream.simulate(_Recurrent(eager=True), (x,), device="h100", training=True)
    ops = [t.op for t in trained.task_graph.tasks if t.name.startswith("eager") and not t.name.endswith(":k")]
    # the layer and its backward, each one op, as lstm_train in a captured graph; not its per-step backward
    assert ops.count("fxdream.lstm_train") == 1 and ops.count("fxdream.lstm_train_backward") == 1
    assert not any(op in ops for op in ("aten.sigmoid_backward", "aten.tanh_backward", "aten.mm"))
    # the parameters' AccumulateGrad (the backward's end) detach each gradient: the engine's, not the model's ops
    assert not [t for t in trained.task_graph.tasks if t.name.startswith("eager_end") and t.op == "aten.detach"]


class _CellLoop(nn.Module):
    """An LSTM cell stepped over the sequence in Python, eagerly where ``eager``, then a linear layer."""

    def __init__(self, eager: bool):
        super().__init__()
        self.cell, self.out = nn.LSTMCell(16, 32), nn.Linear(32, 8)
        self.loop = torch.compiler.disable(self._loop) if eager else self._loop

    def _loop(self, x):
        h = c = x.new_zeros(x.shape[0], 32)
        for t in range(x.shape[1]):
            h, c = self.cell(x[:, t], (h, c))
        return h

    def forward(self, x):
        return self.out(self.loop(x))


def test_an_eager_rnn_cell_is_one_op_as_in_an_inference_graph():
    x = torch.randn(4, 6, 16)
    eager = fxdream.simulate(_CellLoop(eager=True), (x,), device="h100")
    compiled = fxdream.simulate(_CellLoop(eager=False), (x,), device="h100")
    cells = [t for t in eager.task_graph.tasks if t.op == "fxdream.rnn_cell_inference" and t.kind == "cpu"]
    assert len(cells) == 6 and all(t.name.startswith("eager") for t in cells)  # not ~20 ops a step
    assert eager.time_ms == pytest.approx(compiled.time_ms, rel=1e-6)  # the same cells and views, costed alike


class _Between(nn.Module):
    """Two linear layers with ``between``, a function of the first one's output, run between them:
    dynamo breaks the graph there."""

    def __init__(self, between, width: int = 256):
        super().__init__()
        self.first, self.second, self.between = nn.Linear(width, width), nn.Linear(width, width), between

    def forward(self, x):
        return self.second(self.between(self.first(x)))


def _prints(h):
    print("", end="")  # a graph break with no op of its own
    return h


def _reads_a_value(h):
    return h.relu() if h.mean().item() > -1e9 else h  # a device value read on the host; always taken


def _draws_on_the_host(h):
    return h.relu() if torch.rand([]) < 2.0 else h  # a CPU scalar read on the host, as Hugging Face's LayerDrop


def test_the_loss_a_training_step_backpropagates_is_not_costed_as_the_models_eager_ops():
    prediction = fxdream.simulate(_Between(_prints, 32), (torch.randn(2, 16, 32),), device="h100", training=True)
    # fxdream's scalar (a sum), its seed and its backward are not the model's (a model with no
    # break runs them too, uncosted), nor are aot's runtime wrapper's views and copies around
    # each graph (the graph's call costs them): the print runs no ATen op
    assert not [t.name for t in prediction.task_graph.tasks if t.name.startswith("eager")]
    assert "no ATen op ran there" in prediction.notes[0]


def _packed_lstm_events(lengths: list[int]):
    """The profiler's events of a 2-layer LSTM (64 → 128) over a packed batch of 8 sequences."""
    torch.manual_seed(0)
    lstm, x = nn.LSTM(64, 128, num_layers=2, batch_first=True).eval(), torch.randn(8, 32, 64)
    with profiled() as events, torch.no_grad():
        packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
        nn.utils.rnn.pad_packed_sequence(lstm(packed)[0], batch_first=True)
    return events


def test_an_rnn_layer_over_a_packed_sequence_is_its_steps_over_the_rows_they_hold():
    lengths = [32, 30, 28, 20, 32, 10, 5, 32]  # 189 rows over 32 steps: ceil(189 / 32) = 6 a step
    before, skipped = eager_ops(_packed_lstm_events(lengths), calls=0)
    (((phase, graph),),) = before.values()
    assert phase == "fw"
    (layer,) = [n for n in graph.graph.nodes if n.target == torch.ops.fxdream.lstm_inference.default]
    data, states = layer.args[0], layer.args[1]
    assert tuple(data.meta["val"].shape) == (32, 6, 64)
    assert [tuple(s.meta["val"].shape) for s in states] == [(2, 6, 128), (2, 6, 128)]
    # packing and unpacking are composite ops whose output sizes follow the lengths: replayed as
    # the ops they ran, one copy per run of steps with the same batch (6 here) each way
    copies = [n for n in graph.graph.nodes if n.target == torch.ops.aten.copy_.default]
    assert len(copies) == 6 and sum(c.args[1].meta["val"].numel() for c in copies) == sum(lengths) * 128
    assert skipped == {}  # aten::index (its list of optional tensors unrecorded) stands in as a copy


def test_a_packed_lstm_of_full_sequences_costs_its_layer_as_the_padded_lstm():
    tokens, lengths = torch.randint(0, 50, (4, 16)), torch.full((4,), 16)

    class Tagger(nn.Module):
        def __init__(self, packed: bool):
            super().__init__()
            self.embed, self.lstm, self.packed = nn.Embedding(50, 32), nn.LSTM(32, 64, batch_first=True), packed

        def forward(self, tokens, lengths):
            x = self.embed(tokens)
            if self.packed:
                x = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
                return nn.utils.rnn.pad_packed_sequence(self.lstm(x)[0], batch_first=True)[0]
            return self.lstm(x)[0]

    def layer_cost(packed: bool, training: bool) -> dict:
        prediction = fxdream.simulate(Tagger(packed), (tokens, lengths), device="h100", training=training)
        return {t.op: t.duration_us for t in prediction.task_graph.tasks if t.op.startswith("fxdream.lstm")}
    for training in (False, True):
        assert layer_cost(True, training) == layer_cost(False, training) != {}


def test_eager_forward_and_backward_ops_with_no_graph_call_between_are_in_their_phases():
    """An LSTM over a packed sequence after a captured embedding: the step calls the embedding's
    forward, runs the rest eagerly, backward too, then the embedding's backward."""
    model = nn.ModuleDict({"embed": nn.Embedding(50, 32), "lstm": nn.LSTM(32, 64, batch_first=True)})

    class Tagger(nn.Module):
        def __init__(self):
            super().__init__()
            self.parts = model

        def forward(self, tokens, lengths):
            x = nn.utils.rnn.pack_padded_sequence(self.parts["embed"](tokens), lengths, batch_first=True)
            return nn.utils.rnn.pad_packed_sequence(self.parts["lstm"](x)[0], batch_first=True)[0]
    prediction = fxdream.simulate(Tagger(), (torch.randint(0, 50, (4, 16)), torch.full((4,), 16)),
                                  device="h100", training=True)
    groups = list(dict.fromkeys(t.name.split(":")[0] for t in prediction.task_graph.tasks))
    assert groups == ["g0.fw", "eager1.fw", "eager1.bw", "g0.bw", "optim"]
    ops = {group: {t.op for t in prediction.task_graph.tasks if t.name.startswith(group + ":")} for group in groups}
    # the layer where it ran, its backward where the engine ran it; unpacking copies rows in the
    # forward, the packing's backward in the backward
    assert {"fxdream.lstm_train", "aten.copy_"} <= ops["eager1.fw"] and "fxdream.lstm_train_backward" not in ops[
        "eager1.fw"]
    assert {"fxdream.lstm_train_backward", "aten.copy_"} <= ops["eager1.bw"] and "fxdream.lstm_train" not in ops[
        "eager1.bw"]


def test_a_host_read_between_graphs_makes_the_host_wait_for_the_device():
    prediction = fxdream.simulate(_Between(_reads_a_value), (torch.randn(64, 256),), device="h100")
    tasks, times = prediction.task_graph.tasks, prediction.timeline.times
    (sync,) = [t.name for t in tasks if t.kind == "sync"]
    at = times[sync][0]
    # the device has run every kernel launched before the read, and the host goes on only after it
    assert at == max(end for name, (start, end) in times.items() if name.endswith(":k") and start < at)
    after = [t.name for t in tasks[[t.name for t in tasks].index(sync) + 1:] if t.kind == "cpu"]
    assert after and min(times[name][0] for name in after) >= times[sync][1]
    assert "not replayed" not in prediction.notes[-1]


def test_a_host_read_of_a_cpu_tensor_does_not_wait_for_the_device():
    """Captured on the meta device, a value that can be read is a CPU tensor's: a random draw,
    a packed sequence's lengths (the meta copy leaves 1-d integer inputs on the CPU where
    pack_padded_sequence refuses them on the meta device)."""
    def syncs_and_notes(model, inputs):
        prediction = fxdream.simulate(model, inputs, device="h100")
        return sum(t.kind == "sync" for t in prediction.task_graph.tasks), prediction.notes
    syncs, notes = syncs_and_notes(_Between(_draws_on_the_host), (torch.randn(64, 256),))
    assert syncs == 0 and "the eager code where the graph broke" in notes[0]
    syncs, notes = syncs_and_notes(_PackedTagger(), (torch.randn(4, 16, 32), torch.tensor([16, 12, 9, 3])))
    assert syncs == 0 and not any("captured on the example's data" in note for note in notes)
    assert syncs_and_notes(_Between(_reads_a_value), (torch.randn(64, 256),))[0] == 1  # a device value read: one wait


class _PackedTagger(nn.Module):
    def __init__(self):
        super().__init__()
        self.lstm = nn.LSTM(32, 64, batch_first=True)

    def forward(self, x, lengths):
        packed = nn.utils.rnn.pack_padded_sequence(x, lengths, batch_first=True)
        return nn.utils.rnn.pad_packed_sequence(self.lstm(packed)[0], batch_first=True)[0]


class _Selects(nn.Module):
    """Keeps the rows (``nonzero``) or elements (``masked_select``) a device value picks: the
    graph breaks there (an output size that follows values)."""

    def __init__(self, how: str):
        super().__init__()
        self.first, self.second, self.how = nn.Linear(64, 64), nn.Linear(64, 64), how

    def forward(self, x):
        h = self.first(x)
        if self.how == "nonzero":
            return self.second(h.index_select(0, torch.nonzero(h[:, 0] > 0).squeeze(-1))).sum()
        return self.second(torch.masked_select(h, h > 0).reshape(-1, 1).expand(-1, 64)).sum()


@pytest.mark.parametrize("how", ["nonzero", "masked_select"])
def test_an_eager_op_whose_size_follows_values_waits_for_the_device(how):
    """Replayed keeping every element (an upper bound), with the host's wait for the count."""
    x = torch.randn(32, 64)
    on_data = fxdream.simulate(_Selects(how), (x,), device="h100")
    assert sum(t.kind == "sync" for t in on_data.task_graph.tasks) == 1
    with torch.device("meta"):
        model = _Selects(how)
    if how == "nonzero":  # a model built on the meta device: the same, nonzero keeping every element there too
        assert fxdream.simulate(model, (x.to("meta"),), device="h100").time_ms == pytest.approx(on_data.time_ms)
    else:
        with pytest.raises(fxdream.CaptureError, match="no meta kernel"):
            fxdream.simulate(model, (x.to("meta"),), device="h100")
