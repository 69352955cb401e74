"""onednn_graph: a CPU inference graph compiled by oneDNN Graph (TorchScript's LLGA fuser) and
called as one op: equal to eager, opt-in, declining where it cannot compile."""
import pytest
import torch

import fxdream
from fxdream.pass_api import PassContext
from fxdream.pass_registry import available_passes, resolve_passes
from fxdream.passes.onednn_graph import CompiledGraph, OneDnnGraph, has_llga

needs_llga = pytest.mark.skipif(not has_llga(), reason="this torch has no oneDNN Graph fuser")


class ConvNet(torch.nn.Module):
    """conv + BatchNorm + ReLU, a residual add, max pooling and a linear head; the features
    returned twice beside the logits."""
    def __init__(self):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, padding=1)
        self.head = torch.nn.Linear(8 * 4 * 4, 5)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        y = torch.nn.functional.max_pool2d(torch.relu(self.conv2(y) + y), 2)
        return self.head(y.flatten(1)), y, y


def _row(module):
    return next(r for r in module.report.passes if r.name == "onednn_graph")


def _compiled_calls(module):
    return [n for gm in module.rewritten_graphs.values() for n in gm.graph.nodes if isinstance(n.target, CompiledGraph)]


@needs_llga
def test_a_conv_net_runs_as_one_compiled_op_equal_to_eager_and_the_fuser_switch_is_put_back():
    torch.manual_seed(0)
    model, x = ConvNet().eval(), torch.randn(2, 3, 8, 8)
    model.bn.running_mean.uniform_(-1, 1), model.bn.running_var.uniform_(0.5, 2)
    assert not torch.jit.onednn_fusion_enabled()
    module = fxdream.optimize(model, (x,), passes=["onednn_graph"])
    assert not torch.jit.onednn_fusion_enabled()
    assert _row(module).applied and "ops compiled by oneDNN Graph as one op" in _row(module).reason
    assert len(_compiled_calls(module)) == 1
    with torch.no_grad():
        for got, expected in zip(module(x), model(x)):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        other = torch.randn(3, 3, 8, 8)  # another batch: compiled from the same trace
        torch.testing.assert_close(module(other)[0], model(other)[0], rtol=1e-4, atol=1e-5)
    assert "(oneDNN Graph)" in dict(module.report.top_layers)


@needs_llga
def test_an_embedding_model_with_integer_inputs_compiles_and_equals_eager():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(20, 8), torch.nn.Linear(8, 4), torch.nn.GELU()).eval()
    tokens = torch.randint(0, 20, (2, 5))
    module = fxdream.optimize(model, (tokens,), passes=["onednn_graph"])
    assert _row(module).applied
    with torch.no_grad():
        torch.testing.assert_close(module(tokens), model(tokens), rtol=1e-4, atol=1e-5)


class ReturnsItsInput(torch.nn.Module):
    def forward(self, x):
        return x, torch.relu(x)


@needs_llga
def test_a_graph_returning_an_input_is_left_as_it_is_with_the_reason():
    module = fxdream.optimize(ReturnsItsInput(), (torch.randn(4),), passes=["onednn_graph"])
    row = _row(module)
    assert not row.applied and "not a computed tensor" in row.reason
    assert not _compiled_calls(module)


def test_auto_compares_it_alone_and_it_says_where_it_does_not_apply():
    assert "onednn_graph" in available_passes() and OneDnnGraph.alone
    assert resolve_passes(["onednn_graph"])[0].name == "onednn_graph"
    pass_ = OneDnnGraph()
    assert pass_.applies_to(PassContext(device="cuda")) == \
        "oneDNN Graph runs on the CPU; on cuda the graph is left as it is"
    assert pass_.applies_to(PassContext(training=True)) == \
        "oneDNN Graph runs frozen inference graphs: training is left as it is"


def test_a_training_build_reports_the_pass_declined():
    model, x = torch.nn.Linear(4, 2), torch.randn(3, 4)
    module = fxdream.optimize(model, (x,), passes=["onednn_graph"], training=True, cost=None)
    assert not _row(module).applied and "training is left as it is" in _row(module).reason


class WithNone(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x), None


@needs_llga
def test_a_graph_taking_its_parameters_as_inputs_compiles_outside_the_pipelines_fake_mode():
    """Such a graph (a tuple with None returned, any graph dynamo captures, Hugging Face models)
    has the model's parameters as placeholders, made constants under the build's fake mode."""
    torch.manual_seed(0)
    model, x = WithNone().eval(), torch.randn(2, 4)
    module = fxdream.optimize(model, (x,), passes=["onednn_graph"])
    assert _row(module).applied, _row(module).reason
    with torch.no_grad():
        got, none = module(x)
        torch.testing.assert_close(got, model(x)[0], rtol=1e-4, atol=1e-5)
    assert none is None


class Counts(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.count += 1
        return self.fc(x) * self.count


@needs_llga
def test_a_counter_updated_in_forward_is_left_as_it_is_and_counts_as_eager_does():
    """oneDNN Graph returns the 0-d count as a 1-d tensor, which copying it back into the buffer
    would reject: the outputs' shapes are compared, not only their values."""
    torch.manual_seed(0)
    model, x = Counts().eval(), torch.randn(2, 4)
    module = fxdream.optimize(model, (x,), passes=["onednn_graph"])
    assert not _row(module).applied and "in shape or dtype" in _row(module).reason
    before = int(model.count)
    with torch.no_grad():
        module(x), module(x)
    assert int(model.count) == before + 2


@needs_llga
def test_weights_changed_in_place_after_the_build_are_read_as_they_are():
    torch.manual_seed(0)
    model, x = ConvNet().eval(), torch.randn(2, 3, 8, 8)
    module = fxdream.optimize(model, (x,), passes=["onednn_graph"])
    assert _row(module).applied
    with torch.no_grad():
        model.conv.weight.mul_(2)
        torch.testing.assert_close(module(x)[0], model(x)[0], rtol=1e-4, atol=1e-5)
    assert any("weights changed in place after the build" in note for note in module.report.notes)


@needs_llga
def test_with_analytic_costs_it_declines_as_its_one_op_has_no_modelled_cost():
    model, x = ConvNet().eval(), torch.randn(2, 3, 8, 8)
    module = fxdream.optimize(model, (x,), passes="auto", cost="analytic")
    row = _row(module)
    assert not row.applied and "has no analytic cost" in row.reason
    assert not _compiled_calls(module)


class Conv1DBlock(torch.nn.Module):
    """GPT-2's shapes: a weight stored (in, out) and applied with addmm (Hugging Face's Conv1D),
    LayerNorm, GELU written out with tanh."""
    def __init__(self):
        super().__init__()
        self.norm = torch.nn.LayerNorm(8)
        self.weight, self.bias = torch.nn.Parameter(torch.randn(8, 12)), torch.nn.Parameter(torch.randn(12))

    def forward(self, x):
        h = torch.addmm(self.bias, self.norm(x).view(-1, 8), self.weight).view(x.shape[0], x.shape[1], 12)
        return 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))


@needs_llga
def test_an_addmm_of_an_in_out_weight_and_a_layer_norm_compile_as_linear_and_layer_norm():
    torch.manual_seed(0)
    model, x = Conv1DBlock().eval(), torch.randn(2, 5, 8)
    module = fxdream.optimize(model, (x,), passes=["onednn_graph"])
    assert _row(module).applied, _row(module).reason  # the fuser fails on addmm itself
    kinds = {node.kind() for node in _compiled_calls(module)[0].target.script.graph.nodes()}
    assert {"aten::linear", "aten::layer_norm"} <= kinds and not kinds & {"aten::addmm", "aten::native_layer_norm"}
    with torch.no_grad():
        torch.testing.assert_close(module(x), model(x), rtol=1e-4, atol=1e-5)


class TanhGeluMLP(torch.nn.Module):
    """Hugging Face's ``gelu_pytorch_tanh`` MLP: ``F.gelu(approximate="tanh")``."""
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 64), torch.nn.Linear(64, 16)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x), approximate="tanh"))


@needs_llga
def test_a_tanh_gelu_compiles_as_its_formula_equal_to_eager():
    # TorchScript's bridge hands oneDNN Graph a GELU without its approximation: the erf form,
    # 2e-4 off, which the pass's own check declined
    torch.manual_seed(0)
    model, x = TanhGeluMLP().eval(), 3 * torch.randn(8, 16)
    module = fxdream.optimize(model, (x,), passes=["onednn_graph"], eager_check=False)
    assert _row(module).applied, _row(module).reason
    kinds = {node.kind() for node in _compiled_calls(module)[0].target.script.graph.nodes()}
    assert "aten::tanh" in kinds and "aten::gelu" not in kinds
    with torch.no_grad():
        torch.testing.assert_close(module(x), model(x), rtol=1e-5, atol=1e-5)


class AppendsToAnEmptyCache(torch.nn.Module):
    """A first decoding step as Hugging Face's DynamicCache takes it: keys (batch, heads, sequence,
    dim) appended to ``torch.tensor([])``, a 1-d cache without elements that ``cat`` skips."""
    def __init__(self):
        super().__init__()
        self.key = torch.nn.Linear(8, 8)

    def forward(self, x):
        keys = torch.cat([torch.tensor([]), self.key(x).view(2, 4, 2, 8).transpose(1, 2)], dim=-2)
        return keys, keys.softmax(-1)


@needs_llga
def test_a_cat_onto_an_empty_cache_compiles_without_the_empty_operand():
    torch.manual_seed(0)
    model, x = AppendsToAnEmptyCache().eval(), torch.randn(2, 8, 8)
    module = fxdream.optimize(model, (x,), passes=["onednn_graph"])
    assert _row(module).applied, _row(module).reason  # the fuser fails on a partition holding it
    with torch.no_grad():
        other = torch.randn(2, 8, 8)
        for got, expected in zip(module(other), model(other)):
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
            assert got.is_contiguous()


class PromotedByAnEmptyOperand(torch.nn.Module):
    def forward(self, x):
        return torch.cat([torch.tensor([], dtype=torch.float64), torch.relu(x)], dim=-1)


@needs_llga
def test_an_empty_operand_that_promotes_the_cats_dtype_is_kept():
    model, x = PromotedByAnEmptyOperand().eval(), torch.randn(2, 4)
    module = fxdream.optimize(model, (x,), passes=["onednn_graph"])
    with torch.no_grad():
        got = module(x)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, model(x))


def _traced(fn):
    """The torch.fx graph of ``fn(linear, a, b)``, its linear layer ``F.linear`` (as the composite
    graph writes it) on constant weights."""
    import torch.fx as fx
    weight, bias = torch.randn(6, 6), torch.randn(6)

    class Model(torch.nn.Module):
        def forward(self, a, b):
            return fn(lambda x: torch.nn.functional.linear(x, weight, bias), a, b)

    graph = fx.symbolic_trace(Model()).graph
    for node in graph.nodes:
        if node.target is torch._C._nn.linear:
            node.target = torch.nn.functional.linear
    return graph


def test_a_partition_reading_a_tensor_twice_and_adding_another_is_found_and_safe_ones_are_not():
    from fxdream.passes.onednn_graph.bridge_hazards import crashing_partition
    crashes = [lambda lin, a, b: (lin(a) + lin(b)) * b + a,  # each ran to a segfault in the bridge
               lambda lin, a, b: (lin(a) + lin(b)) * 2 + a,
               lambda lin, a, b: torch.relu(lin(a) + lin(b)) + a,
               lambda lin, a, b: (torch.mm(lin(b), a) + lin(a)) * a,  # a matrix product's second operand
               lambda lin, a, b: ((lin(a) + lin(b)) * (a * 2.0) + a * 2.0) * (a * 2.0)]  # one value once merged
    for fn in crashes:
        assert crashing_partition(_traced(fn)) is not None
    safe = [lambda lin, a, b: lin(a) + a,  # the add is into the tensor read twice: its index is right
            lambda lin, a, b: lin(a) * b + a,
            lambda lin, a, b: (lin(a) + lin(b)) * 2 + torch.ones(1),
            lambda lin, a, b: lin(torch.relu(a)) + b]
    for fn in safe:
        assert crashing_partition(_traced(fn)) is None


@needs_llga
def test_one_tensor_passed_twice_into_linears_summed_is_declined_not_crashed():
    class TwoLinears(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(6, 6)

        def forward(self, a, b, c, d):
            return (self.lin(a) + self.lin(b)) * c + d

    torch.manual_seed(0)
    model, x, y = TwoLinears().eval(), torch.randn(3, 6), torch.randn(3, 6)
    built = fxdream.optimize(model, (x, y, y, x), passes=["onednn_graph"])  # one graph input each: a, b
    row = _row(built)
    assert not row.applied and row.reason.startswith("a partition at lin may read one tensor twice")
    with torch.no_grad():
        torch.testing.assert_close(built(x, y, y, x), model(x, y, y, x))


@needs_llga
def test_a_torch_cond_graph_is_declined_saying_what_cannot_be_told():
    class Cond(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)

        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda x: self.a(x).relu(), lambda x: self.b(x) * 2, (x,))

    model, x = Cond().eval(), torch.randn(4, 6)
    built = fxdream.optimize(model, (x,), passes=["onednn_graph"])
    assert _row(built).reason.startswith("the graph calls what is not an ATen op (torch.cond's branches")
    with torch.no_grad():
        for sample in (x, -x):
            torch.testing.assert_close(built(sample), model(sample))


@needs_llga
def test_a_layer_norm_without_affine_parameters_compiles_and_a_failure_names_its_error():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16, elementwise_affine=False)).eval()
    x = torch.randn(4, 8)
    built = fxdream.optimize(model, (x,), passes=["onednn_graph"])
    assert _row(built).applied
    with torch.no_grad():
        torch.testing.assert_close(built(x), model(x))
    from fxdream.passes.onednn_graph import _last_line
    boilerplate = RuntimeError("The following operation failed in the TorchScript interpreter.\n"
                               "Traceback of TorchScript (most recent call last):\nRuntimeError: range check\n")
    assert _last_line(boilerplate) == "RuntimeError: range check"
