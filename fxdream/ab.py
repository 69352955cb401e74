"""A/B runs: a pass's measured effect beside its predicted one, from one process, interleaved.

Baseline is the model run through its captured graphs with no pass; it is what the
prediction's "before" simulates, so measured and predicted deltas compare like with like.
Eager is timed in the same rounds for context. Training rows time forward + backward
(no optimizer step, and the prediction leaves it out too).

The predicted columns simulate the graphs with op costs profiled in context *between the timed
blocks*, so prediction and measurement see the same machine: a shared VM's speed drifts by tens
of % within minutes, and costs from the build would fold that drift into the error. The
prediction ``optimize`` made at build time is kept beside it (``predicted_at_build_ms``).
"""
from __future__ import annotations

import contextlib
import datetime
import itertools
import json
import platform
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from fxdream import models
from fxdream.build import cost_model_for, optimize
from fxdream.capturing.arguments import check_counts, check_inputs
from fxdream.capturing.host_gaps import StepCalls, measure_host_gaps, worth_measuring
from fxdream.capturing.keywords import bind_keywords
from fxdream.capturing.meta import on_meta
from fxdream.capturing.model_state import preserved_modes, preserved_state
from fxdream.capturing.steps import cut_from_callers_graph, differentiable_scalar
from fxdream.measure import Measurement, time_interleaved
from fxdream.numerics import max_abs_diff
from fxdream.pass_registry import resolve_passes
from fxdream.runtime.host_memory import FAULTS_WORTH_A_NOTE
from fxdream.sim.cost.profiled import Profiled
from fxdream.sim.prediction import predict, this_machine_device
from fxdream.sim.trace import _figure_api


@dataclass(frozen=True)
class ABRow:
    model: str
    batch: int
    training: bool
    passes: tuple[str, ...]
    eager: Measurement
    baseline: Measurement
    optimized: Measurement
    predicted_baseline_ms: float
    predicted_optimized_ms: float
    max_abs_diff: float
    pass_reasons: tuple[str, ...]
    predicted_at_build_ms: float | None = None  # optimize()'s own prediction, from its build's costs
    predicted_optimized_ms_range: tuple[float, float] | None = None  # (low, high): the costs' measured spread
    predicted_at_build_ms_range: tuple[float, float] | None = None

    @property
    def in_range(self) -> bool | None:
        """Whether the measured optimized time falls in its predicted range (None: no range)."""
        bounds = self.predicted_optimized_ms_range
        return None if bounds is None else bounds[0] <= self.optimized.median_ms <= bounds[1]

    @property
    def in_range_at_build(self) -> bool | None:
        """The same for optimize()'s own prediction, made at build time."""
        bounds = self.predicted_at_build_ms_range
        return None if bounds is None else bounds[0] <= self.optimized.median_ms <= bounds[1]

    @property
    def measured_delta_pct(self) -> float:
        return 100.0 * (self.optimized.median_ms / self.baseline.median_ms - 1.0)

    @property
    def predicted_delta_pct(self) -> float:
        return 100.0 * (self.predicted_optimized_ms / self.predicted_baseline_ms - 1.0)

    @property
    def error_pct(self) -> float:
        """Predicted optimized time vs measured optimized time."""
        return 100.0 * (self.predicted_optimized_ms / self.optimized.median_ms - 1.0)

    def to_dict(self) -> dict:
        data = asdict(self)
        data.update(measured_delta_pct=self.measured_delta_pct, predicted_delta_pct=self.predicted_delta_pct,
                    error_pct=self.error_pct, in_range=self.in_range, in_range_at_build=self.in_range_at_build)
        return data


@dataclass(frozen=True)
class ABResult:
    device: str
    torch_version: str
    date: str
    rows: tuple[ABRow, ...]

    def coverage(self, at_build: bool = False) -> float | None:
        """Share of the rows whose measured optimized time fell in the predicted range (between
        the timed blocks, or ``at_build``); None where no row has a range."""
        hits = [r.in_range_at_build if at_build else r.in_range for r in self.rows]
        hits = [h for h in hits if h is not None]
        return sum(hits) / len(hits) if hits else None

    def _mean_width(self, prediction: str) -> str:
        """The ranges' mean width as a share of their prediction: a wide range covers easily."""
        widths = [(bounds[1] - bounds[0]) / getattr(r, prediction) for r in self.rows
                  if (bounds := getattr(r, prediction + "_range")) is not None and getattr(r, prediction)]
        return f"±{50 * sum(widths) / len(widths):.0f} % wide on average" if widths else "–"

    def to_json(self) -> str:
        return json.dumps({"device": self.device, "torch": self.torch_version, "date": self.date,
                           "host": platform.node(), "coverage": self.coverage(),
                           "coverage_at_build": self.coverage(at_build=True),
                           "rows": [r.to_dict() for r in self.rows]}, indent=1)

    def to_markdown(self) -> str:
        lines = [f"A/B on {self.device} (torch {self.torch_version}, {self.date}); times are measured "
                 "medians except the *predicted* columns (costs profiled between the timed blocks; "
                 "'at build': optimize()'s own prediction)",
                 "", "| model | batch | mode | passes | eager ms | baseline ms | optimized ms | predicted "
                 "baseline ms | predicted optimized ms | measured Δ | predicted Δ | error | at build: error "
                 "| max abs diff |",
                 "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in self.rows:
            at_build = "–" if r.predicted_at_build_ms is None else \
                f"{100.0 * (r.predicted_at_build_ms / r.optimized.median_ms - 1.0):+.1f} %"
            lines.append(
                f"| {r.model} | {r.batch} | {'train' if r.training else 'infer'} | {'+'.join(r.passes)} "
                f"| {r.eager.median_ms:.2f} | {r.baseline.median_ms:.2f} ±{r.baseline.spread_pct / 2:.0f}% "
                f"| {r.optimized.median_ms:.2f} ±{r.optimized.spread_pct / 2:.0f}% | {r.predicted_baseline_ms:.2f} "
                f"| {r.predicted_optimized_ms:.2f} | {r.measured_delta_pct:+.1f} % | {r.predicted_delta_pct:+.1f} % "
                f"| {r.error_pct:+.1f} % | {at_build} | {r.max_abs_diff:.1e} |")
        coverage, at_build = self.coverage(), self.coverage(at_build=True)
        if coverage is not None or at_build is not None:
            lines += ["", "Measured optimized time inside its predicted range: "
                      + ", ".join(f"{label} {100 * share:.0f} % (ranges {width})" for label, share, width in
                                  (("between the blocks", coverage, self._mean_width("predicted_optimized_ms")),
                                   ("at build", at_build, self._mean_width("predicted_at_build_ms")))
                                  if share is not None)
                      + f" of {len(self.rows)} row(s)."]
        return "\n".join(lines + self._fault_lines())

    def _fault_lines(self) -> list[str]:
        """A line for the rows where a runner page-faulted ``FAULTS_WORTH_A_NOTE`` times a call or
        more: fresh memory, whose cost moves the times (docs/api.md, fresh memory on the CPU)."""
        rows = []
        for r in self.rows:
            counts = {name: m.page_faults_per_call for name, m in
                      (("eager", r.eager), ("baseline", r.baseline), ("optimized", r.optimized))}
            if any(c is not None and c >= FAULTS_WORTH_A_NOTE for c in counts.values()):
                rows.append(f"{r.model} bs{r.batch} " + ", ".join(f"{name} {c:,.0f}" for name, c in counts.items()
                                                                    if c is not None))
        return ["", "Page faults per call (fresh memory from the allocator; `fxdream.keep_freed_memory()`): "
                + "; ".join(rows) + "."] if rows else []


def user_build(function: Callable, device: str = "cpu", label: str | None = None) -> Callable:
    """``function(batch)`` returning (model, inputs) or (model, inputs, loss_fn or None) as the
    ``build(batch) -> (model, inputs tuple, loss_fn)`` an A/B runs, on ``device``; without a loss,
    training sums the outputs (as the CLI's ``FILE.py:FUNCTION``). ``inputs``: a tensor, a tuple
    of forward's positional arguments, or a dict of its keyword arguments (``input_ids=``...)."""
    name = getattr(function, "__name__", "build")
    label = label or name

    def build(batch: int):
        try:
            built = function(batch)
        except Exception as error:  # the traceback stays chained; the line names the builder
            raise RuntimeError(f"{label}({batch}) raised {type(error).__name__}: {error}") from error
        if not (isinstance(built, tuple) and len(built) in (2, 3)):
            raise TypeError(f"{label}({batch}) must return (model, inputs) or (model, inputs, loss_fn), "
                            f"got {type(built).__name__}" + (f" of {len(built)}" if isinstance(built, tuple) else ""))
        if not isinstance(built[0], torch.nn.Module):
            raise TypeError(f"{label}({batch}) must return (model, inputs) or (model, inputs, loss_fn) with the model "
                            f"a torch.nn.Module, got a {type(built[0]).__name__} first")
        model, inputs = built[:2]
        model, inputs = bind_keywords(model, (), inputs) if isinstance(inputs, dict) else (model, check_inputs(inputs))
        loss_fn = built[2] if len(built) == 3 and built[2] is not None else differentiable_scalar
        if on_meta(model, inputs):  # shapes only, for a prediction: nothing to move
            return model, inputs, loss_fn
        inputs = torch.utils._pytree.tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, inputs)
        return model.to(device), inputs, loss_fn
    build.__name__ = name
    return build


def step_fn(module, inputs, loss_fn, training):
    """One inference call (no_grad), or one training step: grads cleared, forward, loss, backward."""
    if not training:
        def infer():
            with torch.no_grad():
                return module(*inputs)
        return infer

    inputs = cut_from_callers_graph(inputs)

    def train_step():
        for p in module.parameters():
            p.grad = None
        loss_fn(module(*inputs)).backward()
    return train_step


def check_device_here(device: str) -> None:
    """An A/B runs on ``device``: say so plainly where this machine has no such device."""
    try:
        kind = torch.device(device).type
    except RuntimeError:
        kind = str(device)
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}: an A/B measures on this machine, on cpu or cuda; to predict "
                         f"for a GPU: python -m fxdream explain MODEL --device {device}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}: no CUDA device here (torch {torch.__version__}, "
                         "torch.cuda.is_available() is False); measure on cpu, or predict for a GPU "
                         "without one: python -m fxdream explain MODEL --device h100")


def ab(model: str | Callable | torch.nn.Module, passes, batch_sizes=None, training: bool = False,
       device: str = "cpu", tiny: bool = False, rounds: int = 5, block: int = 10, progress: bool = True,
       dtype: torch.dtype = torch.float32, example_inputs=None, loss_fn: Callable | None = None) -> ABResult:
    """For each batch: eager, baseline (no pass) and optimized timed side by side, plus predictions.

    ``model`` is a zoo name, ``build(batch_size)`` returning (model, example_inputs) or (model,
    example_inputs, loss_fn) (``user_build``), or a module with its ``example_inputs`` (a tensor, a
    tuple, or a dict of keyword arguments) and optional ``loss_fn``: one row, at the batch of those
    inputs (their first tensor's leading size). ``batch_sizes``: (1,) unless said. ``passes``:
    names (each applied, forced), or "auto": the subset ``optimize(passes="auto")`` keeps, its
    row naming them after "auto".
    """
    user_module = model if isinstance(model, torch.nn.Module) else None
    if user_module is not None:
        model, batch = _module_as_build(model, example_inputs, loss_fn)
        if batch_sizes not in (None, batch, (batch,), [batch]):
            raise ValueError(f"batch_sizes={batch_sizes!r}: a module with its example_inputs is measured at their "
                             f"batch ({batch}); for other batch sizes give build(batch_size) -> (model, inputs)")
        batch_sizes = batch
    elif example_inputs is not None or loss_fn is not None:
        raise TypeError("example_inputs and loss_fn are for a module given as the model; a zoo name or a "
                        "build(batch_size) function makes its own")
    batch_sizes = (1,) if batch_sizes is None else (batch_sizes,) if isinstance(batch_sizes, int) \
        else tuple(batch_sizes)
    check_counts(batch_sizes=batch_sizes, rounds=rounds, block=block)
    check_device_here(device)
    if isinstance(model, str):
        model_name = model
        build = lambda batch: models.build(model_name, batch, tiny=tiny, device=device, dtype=dtype)  # noqa: E731
    else:
        model_name = getattr(model, "__name__", "model")
        build = user_build(model, device)
    selected = "auto" if passes == "auto" else resolve_passes(passes)
    if not selected:
        raise ValueError(f"passes={passes!r}: an A/B compares the model with passes against it without: name "
                         f"one or more, or 'auto' (the subset optimize(passes='auto') keeps)")
    spec = this_machine_device(device)
    # a module of the user's own: its train/eval flags as they were (each row sets the mode it measures)
    with preserved_modes(user_module) if user_module is not None else contextlib.nullcontext():
        rows = []
        for batch in batch_sizes:
            model, inputs, loss_fn = build(batch)
            if on_meta(model, inputs):
                raise ValueError(f"{model_name}: the model is on the meta device (shapes, no data), and an A/B runs it "
                                 f"here; predict it instead: fxdream.simulate(model, inputs, device=...)")
            model.train(training)
            baseline = optimize(model, inputs, training=training, device=device)
            optimized = optimize(model, inputs, passes=selected, training=training, device=device)
            profile, cost = interleaved_profiler(optimized.captured, block, optimized.rewritten_graphs, spec)
            # one measured step for both: passes rewrite the graphs, not the eager code around them
            # (two measurements would differ by noise and give an unchanged graph a predicted delta)
            step = measured_step(baseline, model, inputs, loss_fn, training, cost)
            measured = time_interleaved(
                {"eager": step_fn(model, inputs, loss_fn, training),
                 "baseline": step_fn(baseline.called_positionally(), inputs, loss_fn, training),
                 "optimized": step_fn(optimized.called_positionally(), inputs, loss_fn, training), PROFILING: profile},
                rounds=rounds, block=block, progress=progress, desc=f"{model_name} bs{batch}")
            before = predict(baseline.captured, cost, training, step=step)
            after = predict(optimized.captured, cost, training, graphs=optimized.rewritten_graphs, step=step)
            reasons = tuple(f"{r.graph_index}/{r.phase}: {'applied' if r.applied else 'not applied'}: {r.reason}"
                            for r in optimized.report.passes)
            names = tuple(p.name for p in selected) if selected != "auto" else ("auto",) + tuple(dict.fromkeys(
                r.name for r in optimized.report.passes if r.applied and r.name != "auto"))
            rows.append(ABRow(model_name, batch, training, names, measured["eager"], measured["baseline"],
                              measured["optimized"], before.time_ms, after.time_ms,
                              max_abs_diff(model, optimized.called_positionally(), inputs, training, loss_fn), reasons,
                              optimized.report.predicted_optimized_ms, after.range_ms,
                              optimized.report.predicted_optimized_ms_range))
    return ABResult(spec, torch.__version__, datetime.date.today().isoformat(), tuple(rows))


def _module_as_build(module: torch.nn.Module, example_inputs, loss_fn) -> tuple[Callable, int]:
    """(``build(batch)`` giving back the module and its example inputs, their batch)."""
    if example_inputs is None:
        raise TypeError(f"ab got a {type(module).__name__} without example_inputs: give the module's example_inputs "
                        f"(one row, at their batch), or a zoo name or build(batch_size) -> (model, inputs[, "
                        f"loss_fn]) for several batch sizes")
    tensors = [t for t in torch.utils._pytree.tree_leaves(example_inputs) if isinstance(t, torch.Tensor) and t.dim()]
    batch = tensors[0].shape[0] if tensors else 1

    def build(_batch: int):
        return module, example_inputs, loss_fn
    build.__name__ = type(module).__name__
    return build, batch


PROFILING = "(profiling)"  # the runner that profiles in context between the timed blocks


def interleaved_profiler(captured, every: int, graphs: dict | None, device) -> tuple[Callable[[], None], Profiled]:
    """(runner, a fresh profiled cost model): the runner times ``captured`` (and ``graphs``, rewritten)
    in context on one call in ``every``. Timed among the runners being measured, its costs come
    from the same minutes as their times, not from the build's."""
    cost, calls = cost_model_for(device, "profiled"), itertools.count()

    def run():
        if next(calls) % every == 0:
            cost.profile_in_context(captured, rounds=1, warmup=1, graphs=graphs, again=True)
    return run, cost


def measured_step(module, model, inputs, loss_fn, training, cost) -> StepCalls | None:
    """The graph calls and host time outside the graphs of this very step (training, graph
    breaks), as optimize() adds them to its predictions; None where costs are not measured here."""
    breaks = len(module._graph_breaks)
    if not isinstance(cost, Profiled) or not worth_measuring(training, len(module.captured), breaks):
        return None
    with preserved_state(model):
        return measure_host_gaps(step_fn(module.called_positionally(), inputs, loss_fn, training),
                                 module._session.clock)


def plot_ab(result: ABResult, path: str) -> None:
    """Measured vs predicted Δ% per row, as grouped bars."""
    Figure, Canvas = _figure_api()
    labels = [f"{r.model}\nbs{r.batch} {'train' if r.training else 'infer'}" for r in result.rows]
    xs = range(len(result.rows))
    fig = Figure(figsize=(max(4, 1.4 * len(labels)), 3.5))
    Canvas(fig)
    ax = fig.subplots()
    ax.bar([x - 0.2 for x in xs], [r.measured_delta_pct for r in result.rows], 0.4, label="measured Δ %")
    ax.bar([x + 0.2 for x in xs], [r.predicted_delta_pct for r in result.rows], 0.4, label="predicted Δ %")
    ax.axhline(0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), labels)
    ax.set_ylabel("time change vs baseline (%)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
