"""Graph code calls plain OpOverloads through ``_op`` (fxdream.direct_calls), and computes the same."""
import copy
import re

import torch
import torch.fx as fx
import torch.nn as nn

import fxdream
from conftest import ConvBnNet
from fxdream.runtime.direct_calls import call_ops_directly, direct, direct_calls


def _graph_module() -> fx.GraphModule:
    graph = fx.Graph()
    x = graph.placeholder("x")
    y = graph.call_function(torch.ops.aten.add.Tensor, (x, x))
    z = graph.call_function(torch.ops.aten.sum.dim_IntList, (y, [0]), {"keepdim": True})
    graph.output(graph.call_function(torch.relu, (z,)))  # not an OpOverload: called as written
    return fx.GraphModule(nn.Module(), graph)


def test_the_code_calls_each_overload_directly_and_copies_keep_it():
    gm, x = _graph_module(), torch.randn(2, 3)
    expected = gm(x)
    call_ops_directly(gm)
    assert "torch.ops.aten.add.Tensor._op(x, x)" in gm.code
    assert "torch.ops.aten.sum.dim_IntList._op(add_tensor, [0], keepdim = True)" in gm.code
    assert "torch.relu(" in gm.code
    assert torch.equal(gm(x), expected)
    assert "._op(" in copy.deepcopy(gm).code  # pass candidates and timed copies run the same code


def test_only_plain_overloads_are_rewritten():
    lines = ["a = torch.ops.aten.add.Tensor(x, y)\n",
             "b = torch.ops.aten.no_such_op.default(a)\n",     # does not resolve: as written
             "c = torch.ops.higher_order.cond(p, f, g, ())\n",  # not NS.OP.OVERLOAD: as written
             "d = torch.ops.aten.add(a, b)\n"]                  # a packet: as written
    assert direct_calls(lines) == ["a = torch.ops.aten.add.Tensor._op(x, y)\n"] + lines[1:]
    assert direct(torch.ops.aten.add.Tensor) is torch.ops.aten.add.Tensor._op
    assert direct(torch.relu) is torch.relu and direct(torch.ops.aten.add) is torch.ops.aten.add


def test_a_graph_with_its_own_code_transformer_is_left_alone():
    gm = _graph_module()
    gm.graph.on_generate_code(lambda _: lambda body: ["# mine\n", *body])
    call_ops_directly(gm)
    gm.recompile()
    assert "# mine" in gm.code and "._op(" not in gm.code


class Small(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x))).softmax(-1)


def test_optimized_graphs_run_direct_calls_and_equal_eager_forward_and_backward():
    torch.manual_seed(0)
    model, x = Small(), torch.randn(5, 8)
    inference = fxdream.optimize(model.eval(), (x,))
    assert all("._op(" in c.forward.code for c in inference.captured)
    with torch.no_grad():
        assert torch.equal(inference(x), model(x))
    training = fxdream.optimize(model.train(), (x,), training=True)
    assert all("._op(" in c.backward.code for c in training.captured)
    training(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).sum().backward()
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))


def test_a_passs_rewritten_graph_calls_its_new_ops_directly():
    torch.manual_seed(0)
    model, x = ConvBnNet().eval(), torch.randn(2, 3, 8, 8)
    optimized = fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"], cost=None)
    code = optimized.rewritten_graphs[(0, "fw")].code
    assert "._op(" in code and not re.search(r"torch\.ops\.\w+\.\w+\.\w+\(", code)  # every op, the new ones too
    with torch.no_grad():
        torch.testing.assert_close(optimized(x), model(x))
