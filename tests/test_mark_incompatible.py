"""mark_incompatible: each kind of incompatibility, on hand-built graphs, with its exact reason."""
import pytest
import torch
import torch.fx as fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.passes.fake_tensor_prop import FakeTensorProp

import fxdream
from fxdream import models
from fxdream.ir.nodes import LAYER
from fxdream.capturing.capture_model import capture
from fxdream.pass_api import PassContext
from fxdream.passes.mark_incompatible import CUDA_GRAPH, MarkIncompatible, cuda_graph_compatible, cuda_graph_incompatible, forget_cuda_graph_op, mark_incompatible

aten = torch.ops.aten
EVAL = PassContext(device="cuda")
TRAIN = PassContext(device="cuda", training=True)


def _graph(build, *inputs, device="cuda"):
    """A graph from ``build(graph, *placeholders)``; meta["val"] from fake tensors on ``device``
    (cuda works without a GPU). ``inputs``: shapes, or (shape, device) / real tensors."""
    graph = fx.Graph()
    placeholders = [graph.placeholder(f"x{i}") for i in range(len(inputs))]
    graph.output(build(graph, *placeholders))
    gm = fx.GraphModule(torch.nn.Module(), graph)
    mode = FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True)
    fakes = []
    for spec in inputs:
        if isinstance(spec, torch.Tensor):
            fakes.append(mode.from_tensor(spec, static_shapes=True))
            continue
        shape, where = spec if isinstance(spec, tuple) and isinstance(spec[-1], str) else (spec, device)
        with mode:
            fakes.append(torch.empty(shape, device=where))
    FakeTensorProp(gm, mode).propagate_dont_convert_inputs(*fakes)
    return gm


def _call(graph, target, *args, name=None, **kwargs):
    return graph.create_node("call_function", target, args, kwargs, name=name)


def _marks(gm, ctx=EVAL):
    return {n.name: r for n, r in mark_incompatible(gm, ctx).items()}


def test_a_plain_graph_has_no_marks_and_the_pass_says_so():
    gm = _graph(lambda g, x: _call(g, aten.relu.default, _call(g, aten.mm.default, x, x)), (4, 4))
    assert _marks(gm) == {}
    result = MarkIncompatible()(gm, EVAL)
    assert (result.modified, result.reason, result.notes) == (False, "every node is compatible with CUDA graphs", ())


def test_host_sync_item_and_the_host_value_it_feeds():
    def build(g, x):
        s = _call(g, aten.sum.default, x, name="sum")
        item = _call(g, aten._local_scalar_dense.default, s, name="item")
        return _call(g, aten.mul.Tensor, x, item, name="scaled")
    marks = _marks(_graph(build, (4,)))
    assert marks == {
        "item": "host synchronisation: aten._local_scalar_dense copies a device value to the host (like .item())",
        "scaled": "reads a host value: 'item' (aten._local_scalar_dense) is computed at run time; a CUDA graph "
                  "would replay the value it had at capture",
    }


def test_data_dependent_shapes_nonzero_and_boolean_mask_but_not_long_indices():
    def build(g, x, idx):
        nz = _call(g, aten.nonzero.default, x, name="nonzero")
        gathered = _call(g, aten.index.Tensor, x, [idx], name="gather")
        mask = _call(g, aten.gt.Scalar, x, 0.0, name="mask")
        picked = _call(g, aten.index.Tensor, x, [mask], name="masked")
        return nz, gathered, picked
    gm = _graph(build, (6,), torch.tensor([0, 2]), device="cpu")
    marks = _marks(gm)
    reason = ("data-dependent output shape: the size of aten.{}'s output depends on tensor values "
              "(it synchronises with the host and allocates at run time)")
    assert marks == {"nonzero": reason.format("nonzero"), "masked": reason.format("index")}


def test_cpu_tensor_in_a_cuda_graph_but_not_a_0d_cpu_scalar():
    def build(g, x, cpu_vec, cpu_scalar):
        a = _call(g, aten.add.Tensor, x, cpu_scalar, name="add_scalar")
        return _call(g, aten.mul.Tensor, a, cpu_vec, name="mul_vector")
    gm = _graph(build, (3,), (3,), ((), "cpu"))
    vector = next(n for n in gm.graph.nodes if n.name == "x1")
    with FakeTensorMode():
        vector.meta["val"] = torch.empty(3, device="cpu")  # fake propagation refuses mixed devices
    assert _marks(gm) == {"mul_vector": "CPU tensor in a CUDA graph: 'x1' (shape [3]) is on the CPU; only 0-d CPU "
                                        "scalars are copied to the device"}


def test_a_cpu_op_is_marked_unless_it_makes_a_constant_scalar():
    def build(g, x, cpu_scalar):
        const = _call(g, aten.scalar_tensor.default, 2.0, name="const")  # a constant: fine
        varying = _call(g, aten.mul.Tensor, cpu_scalar, 3.0, name="cpu_mul")  # recomputed per call: not
        return _call(g, aten.mul.Tensor, _call(g, aten.add.Tensor, x, const, name="add"), varying, name="mul")
    marks = _marks(_graph(build, (3,), ((), "cpu")))
    assert marks == {"cpu_mul": "runs on the CPU: aten.mul computes a CPU tensor (shape []) that a CUDA graph "
                                "would not recompute on replay"}


def test_cpu_tensors_are_no_reason_when_the_whole_graph_is_on_the_cpu():
    gm = _graph(lambda g, x, y: _call(g, aten.mul.Tensor, x, y), (3,), (3,), device="cpu")
    assert _marks(gm) == {}


def _dropout_graph(train=True):
    return _graph(lambda g, x: _call(g, aten.native_dropout.default, x, 0.1, train, name="dropout"), (8,))


def test_dropout_is_marked_in_training_only():
    reason = ("random numbers in training: aten.native_dropout draws new values on every call "
              "(dropout is compatible in eval)")
    assert _marks(_dropout_graph(), TRAIN) == {"dropout": reason}
    assert _marks(_dropout_graph(), EVAL) == {}
    assert _marks(_dropout_graph(train=False), TRAIN) == {}  # draws nothing: an identity


def _attention_graph(dropout_p, by_keyword=False):
    def build(g, q, k, v):
        keyword = dict(dropout_p=dropout_p) if by_keyword else {}
        positional = () if by_keyword else (dropout_p,)
        return _call(g, aten._scaled_dot_product_efficient_attention.default, q, k, v, None, True, *positional,
                     name="attention", **keyword)
    return _graph(build, (2, 2, 12, 16), (2, 2, 12, 16), (2, 2, 12, 16))


def test_attention_without_dropout_draws_nothing_and_is_not_marked():
    """Attention layers built with no dropout (Llama's attention_dropout=0) call SDPA with
    dropout_p=0: no random numbers, so no reason to split a CUDA-graph region there."""
    assert _marks(_attention_graph(0.0), TRAIN) == {}
    assert _marks(_attention_graph(0.0, by_keyword=True), TRAIN) == {}
    assert _marks(_attention_graph(0.1), TRAIN) == {
        "attention": "random numbers in training: aten._scaled_dot_product_efficient_attention draws new values "
                     "on every call (dropout is compatible in eval)"}


def test_dropout_on_a_captured_model_training_vs_eval():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.1), torch.nn.ReLU(),
                                torch.nn.Linear(8, 8), torch.nn.Dropout(0.2))
    inputs = (torch.randn(2, 8),)
    train = capture(model, inputs, training=True)
    marks = mark_incompatible(train.forward, PassContext(device="cuda", training=True, phase="fw"))
    assert sorted(n.meta[LAYER] for n in marks) == ["1", "4"]
    assert all(r.startswith("random numbers in training: aten.native_dropout") for r in marks.values())
    model.eval()
    assert mark_incompatible(capture(model, inputs).forward, EVAL) == {}  # dropout is gone in eval


def test_mutation_of_a_graph_input_names_the_input_the_layer_and_the_line():
    def build(g, x, y):
        r = _call(g, aten.relu.default, y, name="relu")
        view = _call(g, aten.view.default, x, [4], name="x_view")
        return _call(g, aten.copy_.default, view, r, name="copy_")
    gm = _graph(build, (4,), (4,))
    node = next(n for n in gm.graph.nodes if n.name == "copy_")
    node.meta[LAYER] = "bn1"
    node.meta["stack_trace"] = '  File "model.py", line 12, in forward\n    self.running_mean.copy_(y.relu())\n'
    ctx = PassContext(device="cuda", params={"x0": torch.zeros(4)})
    assert _marks(gm, ctx) == {
        "copy_": "mutates graph input 'x0' (the model's parameter or buffer) in place in layer 'bn1' "
                 "(File \"model.py\", line 12, in forward: self.running_mean.copy_(y.relu())); "
                 "a CUDA graph writes to its own copy of the input"}
    assert _marks(gm)["copy_"].startswith("mutates graph input 'x0' (graph input #0) in place in layer 'bn1'")


def test_an_op_tagged_cudagraph_unsafe():
    if not hasattr(torch.Tag, "cudagraph_unsafe"):
        pytest.skip("this torch has no cudagraph_unsafe tag")
    lib = torch.library.Library("fxdream_cg_test", "FRAGMENT")
    if not hasattr(torch.ops.fxdream_cg_test, "unsafe"):
        lib.define("unsafe(Tensor x) -> Tensor", tags=(torch.Tag.cudagraph_unsafe,))
        lib.impl("unsafe", lambda x: x.clone(), "CompositeExplicitAutograd")
        lib.impl("unsafe", lambda x: torch.empty_like(x), "Meta")
    gm = _graph(lambda g, x: _call(g, torch.ops.fxdream_cg_test.unsafe.default, x, name="unsafe"), (4,))
    assert _marks(gm) == {"unsafe": "fxdream_cg_test.unsafe is tagged cudagraph_unsafe"}


def test_sparse_tensor():
    sparse = torch.eye(3).to_sparse()
    gm = _graph(lambda g, x: _call(g, aten.add.Tensor, x, x, name="add"), sparse, device="cpu")
    assert _marks(gm) == {"add": "sparse tensor: 'x0' has layout sparse_coo"}


def test_symbolic_sizes_and_non_tensor_outputs():
    from torch.fx.experimental.proxy_tensor import make_fx
    gm = make_fx(lambda x: torch.relu(x) + x.shape[0], tracing_mode="symbolic")(torch.randn(4, 3))
    marks = _marks(gm)
    assert set(marks) == {"relu", "sym_size_int", "add"}
    assert all(r.startswith("dynamic shape: ") for r in marks.values())
    assert "has symbolic size s" in marks["relu"]

    static = _graph(lambda g, x: _call(g, aten.sym_size.int, x, 0, name="size"), (4, 3))
    assert _marks(static) == {"size": "non-tensor output: aten.sym_size returns a Python int, a value on the host"}


def test_control_flow_and_non_aten_calls():
    graph = fx.Graph()
    x = graph.placeholder("x")
    cond = graph.create_node("call_function", torch.ops.higher_order.cond, (x, x, x, (x,)), name="cond")
    method = graph.call_method("sum", (x,))
    graph.output((cond, method))
    marks = _marks(fx.GraphModule(torch.nn.Module(), graph))
    assert marks == {"cond": "control flow: cond decides what runs from a tensor value",
                     method.name: "not an ATen call (call_method sum): fxdream cannot check it"}


def test_a_user_registered_incompatible_op_and_a_compatible_override():
    gm = _graph(lambda g, x: (_call(g, aten.relu.default, x, name="relu"),
                              _call(g, aten.nonzero.default, x, name="nonzero")), (4,))
    fxdream.cuda_graph_incompatible(aten.relu, "our relu calls a host library")  # the top-level name
    cuda_graph_compatible("aten.nonzero.default")
    try:
        # the op rule is overridden; the check on the values (a size known at run time) is not
        assert _marks(gm) == {"relu": "our relu calls a host library",
                              "nonzero": "data-dependent size: its output has size u0, known only at run time"}
        cuda_graph_compatible(aten.native_dropout)
        assert _marks(_dropout_graph(), TRAIN) == {}
        cuda_graph_incompatible("aten.relu.default", lambda node, ctx: "only in training" if ctx.training else None)
        assert "relu" not in _marks(gm, EVAL)
        assert _marks(gm, TRAIN)["relu"] == "only in training"
    finally:
        forget_cuda_graph_op(aten.relu)
        forget_cuda_graph_op("aten.relu.default")
        forget_cuda_graph_op("aten.nonzero.default")
        forget_cuda_graph_op(aten.native_dropout)
    assert set(_marks(gm)) == {"nonzero"}
    assert set(_marks(_dropout_graph(), TRAIN)) == {"dropout"}
    with pytest.raises(ValueError, match="no operator 'aten.not_an_op'"):
        cuda_graph_incompatible("aten.not_an_op", "x")
    with pytest.raises(TypeError, match="reason must be"):
        cuda_graph_incompatible(aten.relu, "")


def test_the_report_lists_every_marked_node_by_layer_and_the_graph_is_unchanged():
    def build(g, x):
        a = _call(g, aten.native_dropout.default, x, 0.5, True, name="drop_a")
        b = _call(g, aten.nonzero.default, x, name="nz")
        c = _call(g, aten.native_dropout.default, x, 0.5, True, name="drop_b")
        return a, b, c
    gm = _graph(build, (8,))
    for node, layer in zip([n for n in gm.graph.nodes if n.op == "call_function"], ["enc.0", "head", "enc.0"]):
        node.meta[LAYER] = layer
    code = gm.code
    result = MarkIncompatible()(gm, TRAIN)
    assert not result.modified and gm.code == code
    assert result.reason == ("3 node(s) cannot be in a CUDA graph (2 random numbers in training, 1 data-dependent "
                             "output shape); metadata only, the graph is unchanged")
    assert [line.split(": ", 2)[:2] for line in result.notes] == [["enc.0", "drop_a"], ["enc.0", "drop_b"],
                                                                 ["head", "nz"]]
    assert all(n.meta[CUDA_GRAPH] for n in gm.graph.nodes if n.op == "call_function")


def test_the_pass_is_registered_and_runs_in_optimize():
    assert {"mark_incompatible", "cuda_graphs"} <= set(fxdream.available_passes())
    model, inputs, _ = models.build("mnist_convnet", 2, tiny=True)
    model.eval()
    optimized = fxdream.optimize(model, inputs, passes=["mark_incompatible"], cost=None)
    (row,) = optimized.report.passes
    assert not row.applied and row.reason == "every node is compatible with CUDA graphs"


def test_a_prepacked_convolution_weight_is_no_sparse_tensor():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()
    built = fxdream.optimize(model, (torch.randn(2, 3, 16, 16),), passes=["fuse_conv_bias_act", "mark_incompatible"],
                             cost=None)
    fused, marked = built.report.passes[:2]
    assert fused.applied and "prepacked" in fused.reason
    assert marked.reason == "every node is compatible with CUDA graphs"
