"""A forward that sets a Python attribute on its first call (as Hugging Face's classifiers set
``config.problem_type``): dynamo compiles it again on the next call. The recompilation is named
in the report, and the host time around the graphs is never taken from a step that compiled."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxdream
from fxdream.capturing import host_gaps


class Config:
    problem_type = None


class SetsItsProblemTypeOnTheFirstCall(nn.Module):
    def __init__(self):
        super().__init__()
        self.config = Config()
        self.fc = nn.Linear(16, 4)

    def forward(self, x, labels):
        if self.config.problem_type is None:
            self.config.problem_type = "single_label_classification"
        logits = self.fc(x)
        if self.config.problem_type == "single_label_classification":
            return F.cross_entropy(logits, labels)
        return logits.sum()


def test_the_recompilation_is_named_and_the_prediction_is_not_its_compile_time():
    torch.manual_seed(0)
    model, x, labels = SetsItsProblemTypeOnTheFirstCall(), torch.randn(8, 16), torch.randint(0, 4, (8,))
    optimized = fxdream.optimize(model, (x, labels), training=True, passes="auto")
    report = optimized.report
    assert any("recompiles graph 0" in note and "a non-tensor argument" in note for note in report.notes), report.notes
    # a compilation (dynamo and aot) takes hundreds of milliseconds; the step a few, and under
    # 25 even where another process keeps a core busy (each of the loss's parallel ops then waits
    # for a time slice)
    assert report.predicted_baseline_ms is not None and report.predicted_baseline_ms < 100, report.notes
    for module in (optimized, model):
        for p in model.parameters():
            p.grad = None
        module(x, labels).backward()
        if module is optimized:
            got = [p.grad.clone() for p in model.parameters()]
    for g, p in zip(got, model.parameters()):
        torch.testing.assert_close(g, p.grad)


class BreaksAndDrops(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.dropout = nn.Linear(4, 4), nn.Dropout(0.5)

    def forward(self, x):
        y = self.fc(x)
        if x.sum() > 0:  # data-dependent: dynamo captures it
            y = y * 2
        return self.dropout(y)


def test_a_recompilation_after_model_train_names_the_mode_as_its_cause():
    torch.manual_seed(0)
    model, x = BreaksAndDrops().eval(), torch.randn(2, 4).abs()
    optimized = fxdream.optimize(model, (x,), cost=None)
    model.train()
    with torch.no_grad():
        optimized(x)
    note = next(n for n in optimized.report.notes if "recompiles graph" in n)
    assert "the model's train/eval mode differs from that graph's (model.train() / model.eval())" in note
    assert "non-tensor argument" not in note


class _FakeTime:
    """perf_counter for ``measure_host_gaps``: each step advances it by what the step says."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


def test_host_time_is_never_taken_from_a_step_that_compiled(monkeypatch):
    clock, fake = host_gaps.SubgraphClock(), _FakeTime()
    monkeypatch.setattr(host_gaps, "time", fake)
    compiling = [True, False, True, False, False, False]  # a recompilation after the first call

    def step():
        if compiling.pop(0):
            clock.compilations += 1
            fake.now += 5.0  # seconds: a compilation
        else:
            fake.now += 0.001
    measured = host_gaps.measure_host_gaps(step, clock, rounds=3, warmup=1, budget_s=100.0)
    assert measured is not None and measured.end_us == pytest.approx(1000.0)  # 1 ms steps only
    assert compiling == []  # the compiling steps counted as neither warm-up nor sample


def test_no_steady_step_measures_nothing(monkeypatch):
    clock, fake = host_gaps.SubgraphClock(), _FakeTime()
    monkeypatch.setattr(host_gaps, "time", fake)

    def step():
        clock.compilations += 1
        fake.now += 0.01
    assert host_gaps.measure_host_gaps(step, clock, rounds=3, warmup=1) is None


def test_a_measurement_that_allows_no_compiling_step_stops_at_the_first(monkeypatch):
    clock, fake = host_gaps.SubgraphClock(), _FakeTime()
    monkeypatch.setattr(host_gaps, "time", fake)
    steps = []

    def step():
        steps.append(1)
        clock.compilations += 1  # every call compiles again
        fake.now += 0.001
    assert host_gaps.measure_host_gaps(step, clock, rounds=3, warmup=1, compiling_steps=0) is None
    assert len(steps) == 1  # not the steps a model that recompiles would compile for
