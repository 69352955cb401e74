"""A graph run in aot_autograd's boxed convention frees each input at its last use."""
import weakref

import torch
import torch.fx as fx

import fxdream
from fxdream.runtime.boxed import boxed_runner
from fxdream.runtime.direct_calls import call_ops_directly

aten = torch.ops.aten


def _scale_then_add(seen: list, first_input: list) -> fx.GraphModule:
    """(a, b) → a * 2 + b, with a probe after a's last use recording whether a is still alive."""
    def probe(t):
        seen.append(first_input[0]() is None)
        return t
    graph = fx.Graph()
    a, b = graph.placeholder("a"), graph.placeholder("b")
    doubled = graph.call_function(probe, (graph.call_function(aten.mul.Tensor, (a, 2)),))
    graph.output(graph.call_function(aten.add.Tensor, (doubled, b)))
    return call_ops_directly(fx.GraphModule(torch.nn.Module(), graph))


def test_the_argument_list_is_emptied_and_an_input_dies_at_its_last_use():
    seen, first_input = [], []
    gm = _scale_then_add(seen, first_input)
    args = [torch.ones(3), torch.ones(3)]
    first_input.append(weakref.ref(args[0]))
    run = boxed_runner(gm)
    assert run._boxed_call
    out = run(args)
    assert args == [] and seen == [True]
    torch.testing.assert_close(out, torch.full((3,), 3.0))
    assert "args_list" not in gm.code and "._op(" in run.__self__.code  # gm untouched; direct calls kept


def test_a_module_that_is_not_a_plain_graph_is_called_with_the_list_unpacked():
    run = boxed_runner(torch.nn.ReLU())
    torch.testing.assert_close(run([torch.tensor([-1.0, 2.0])]), torch.tensor([0.0, 2.0]))


def test_a_retained_graph_runs_its_backward_twice():
    """Emptying the list the backward gets leaves autograd's saved tensors alone: a second
    backward over a retained graph reads them again (donated buffers off, as torch asks)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    x = torch.randn(5, 8)
    with torch._functorch.config.patch(donated_buffer=False):
        captured = fxdream.optimize(model, (x,), training=True)
        out = captured(x)
        out.sum().backward(retain_graph=True)
        first = [p.grad.clone() for p in model.parameters()]
        out.sum().backward()
    for once, twice in zip(first, (p.grad for p in model.parameters())):
        torch.testing.assert_close(twice, 2 * once)
