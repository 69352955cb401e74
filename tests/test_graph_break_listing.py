"""Graph breaks are listed once each; subgraphs that compute nothing are not counted."""
import pytest
import torch
import torch.fx as fx

import fxdream
from fxdream.capturing import dynamo
from fxdream.capturing.dynamo import compile_with
from fxdream.capturing.captured import Captured
from fxdream.optimized_module import _graphs_with_ops


def test_a_reason_counted_as_a_break_and_as_giving_up_is_listed_once(monkeypatch):
    counts = {"Unsupported Tensor.item() call": 1, dynamo._SKIPPED + "Unsupported Tensor.item() call": 1,
              "Call to `torch._dynamo.graph_break()`": 2, "an old break": 3}
    monkeypatch.setattr(dynamo, "graph_break_counts", lambda: counts)
    assert dynamo.new_graph_breaks({"an old break": 3}) == (
        "Unsupported Tensor.item() call" + dynamo.WHOLE_FUNCTION, "Call to `torch._dynamo.graph_break()`")


def _captured(index: int, ops: int) -> Captured:
    graph = fx.Graph()
    x = graph.placeholder("x")
    for _ in range(ops):
        x = graph.call_function(torch.ops.aten.relu.default, (x,))
    graph.output(x)
    gm = fx.GraphModule(torch.nn.Module(), graph)
    return Captured(index, gm, None, gm, False, ((2,),))


def test_subgraphs_with_no_op_are_left_out_of_the_report():
    graphs = _graphs_with_ops([_captured(0, 2), _captured(1, 0), _captured(2, 1)])
    assert [g.index for g in graphs] == [0, 2] and [g.forward_ops for g in graphs] == [2, 1]


def test_a_reason_reads_the_same_in_every_build():
    text = "Backend compiler exception\nExplanation: Backend compiler `<a.b.Session object at 0x7f1db4f05490>` failed"
    assert dynamo._first_line(text) == "Backend compiler exception — Backend compiler `<a.b.Session>` failed"


class ChangesItselfOnItsFirstCall(torch.nn.Module):
    """Breaks the graph on its first call only, then never again (as Hugging Face BigBird swaps
    its attention module on a first call with a short sequence)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)
        self.first_call = True

    def forward(self, x):
        if self.first_call:
            torch._dynamo.graph_break()
            self.first_call = False
        return self.linear(x).relu()


class AlwaysBreaks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        x = self.linear(x)
        torch._dynamo.graph_break()
        return x.relu()


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_breaks_of_the_first_call_only_are_a_note_and_the_same_build_twice_lists_the_same(monkeypatch, training):
    monkeypatch.setattr(fxdream.build, "compile_model", lambda model, inputs, session, training: (
        compile_with(model, session), "dynamo (test)"))
    model, x = ChangesItselfOnItsFirstCall(), torch.randn(2, 4)
    first = fxdream.optimize(model, (x,), passes=(), cost=None, training=training)
    second = fxdream.optimize(model, (x,), passes=(), cost=None, training=training)
    assert first.report.graph_breaks == second.report.graph_breaks == ()
    (note,) = [n for n in first.report.notes if "the first call changed the model" in n]
    assert "met 1 graph break(s) later calls do not" in note and "graph_break()" in note
    with torch.no_grad():
        torch.testing.assert_close(first(x), model(x))
    always = fxdream.optimize(AlwaysBreaks(), (x,), passes=(), cost=None, training=training)
    assert len(always.report.graph_breaks) == 1 and "graph_break()" in always.report.graph_breaks[0]
    assert not [n for n in always.report.notes if "first call" in n]


def test_a_prediction_that_measures_nothing_says_what_became_of_the_eager_code_at_a_break():
    from conftest import TwoSubgraphs
    model, x = TwoSubgraphs(), torch.randn(3, 4)
    elsewhere = fxdream.simulate(model, (x,), device="h100", training=True)  # captured on the meta device
    assert any(n.startswith("the eager code where the graph broke") and "no ATen op ran there" in n
               for n in elsewhere.notes)  # a graph_break() alone: the compiled runtime's ops are the calls'
    here = fxdream.simulate(model, (x,), device="cpu", training=True)  # measured: the gaps are tasks
    assert not any(n.startswith("not in this prediction") for n in here.notes)
    assert any(n.startswith("measured host time outside the graphs") for n in here.notes)


class Energy(torch.nn.Module):
    """Forces as the gradient of an energy, taken inside forward."""

    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 16), torch.nn.Linear(16, 1)

    def forward(self, x):
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            energy = self.b(torch.tanh(self.a(x))).sum()
            force, = torch.autograd.grad(energy, x)
        return -force


def test_a_backward_a_forward_runs_lists_only_the_models_own_breaks():
    """The backward graph is compiled at its first call, here while dynamo traces the forward's
    frames: fxdream's compiler and runner are not traced as the model's code."""
    model, x = Energy().eval(), torch.randn(4, 8)
    optimized = fxdream.optimize(model, (x,), eager_check=False, cost=None)
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))
    breaks = optimized.report.graph_breaks
    assert len(breaks) == 2 and any("torch.autograd.grad" in b for b in breaks), breaks
