"""Host gaps named by the module that ran in them: eager code between graphs in measured predictions."""
import sys
import time

import torch
from torch import nn

import fxdream
from fxdream.capturing.gap_layers import gap_layers, module_calls
from fxdream.capturing.host_gaps import SubgraphClock, measure_host_gaps


def test_each_gap_is_split_among_the_outermost_module_calls_inside_it():
    events = [("g0.fw", 10.0, 20.0), ("g1.fw", 50.0, 60.0)]  # graph calls: gaps 0-10, 20-50, 60-100
    calls = [(1.0, 4.0, "pre"),                     # inside the first gap
             (22.0, 30.0, "head.norm"), (31.0, 38.0, "head.lin"), (21.0, 39.0, "head"),  # nested in head
             (41.0, 47.0, "tail"),                  # head's sibling
             (55.0, 70.0, "spans.a.call"),          # crosses a graph call: no gap's
             (0.0, 100.0, "wrapper")]               # around every call: no gap's
    assert gap_layers(events, calls, 0.0, 100.0) == ((("pre", 0.3),), (("head", 0.6), ("tail", 0.2)), ())


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(256, 256)

    @torch.compiler.disable
    def forward(self, x):
        for _ in range(8):
            x = torch.tanh(self.lin(x))
        return x


class _BodyAndEagerHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.head = nn.Linear(256, 256), _Head()

    def forward(self, x):
        return self.head(self.body(x).relu()).sum()


def test_a_measured_prediction_names_the_eager_module_between_graphs():
    # a training step on this machine: the host time between the graphs is measured, not replayed
    prediction = fxdream.simulate(_BodyAndEagerHead(), (torch.randn(32, 256),), device="cpu", training=True)
    gaps = [t for t in prediction.task_graph.tasks if t.op == "host_gap"]
    assert [(t.phase, t.layer) for t in gaps if t.layer] == [("fw", "head")]  # its backward: autograd's engine
    assert "head" in dict(prediction.top_layers(5))


def test_module_calls_leave_a_users_profile_function_alone():
    def users(frame, event, arg):
        return None
    model = _BodyAndEagerHead()
    sys.setprofile(users)
    try:
        with module_calls(model) as calls:
            model(torch.randn(2, 256))
        assert sys.getprofile() is users
    finally:
        sys.setprofile(None)
    assert calls == []
    with module_calls(model) as calls:
        model(torch.randn(2, 256))
    assert {name for _, _, name in calls} == {"body", "head", "head.lin"}


def test_the_step_that_times_module_calls_is_never_a_sample():
    # a long step whose gaps are a small share of it: its cold warm-up would do as the sample,
    # but not one the profile function slowed
    clock, model, steps = SubgraphClock(), _BodyAndEagerHead(), []
    graph = clock.wrap(lambda args: time.sleep(0.01) or args, "g0.fw")

    def step():
        steps.append(sys.getprofile() is not None)
        graph([model.body(torch.randn(2, 256))])
    assert measure_host_gaps(step, clock, rounds=1, warmup=1, budget_s=0.001).calls == ("g0.fw",)
    assert steps == [False]  # unnamed: the cold step is the sample
    steps.clear()
    named = measure_host_gaps(step, clock, rounds=1, warmup=1, budget_s=0.001, modules_of=model)
    assert steps == [True, False] and named.gap_layers[0][0][0] == "body"
