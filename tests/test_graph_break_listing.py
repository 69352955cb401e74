"""Graph breaks are listed once each; subgraphs that compute nothing are not counted."""
import torch
import torch.fx as fx

from fxdream.capturing import dynamo
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
