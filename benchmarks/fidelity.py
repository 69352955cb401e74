"""Simulation fidelity on this CPU: predicted (profiled costs) vs measured time per iteration.

For each zoo model × batch × {inference, training step (forward + backward)}: the
model run through its captured graphs with no pass is timed (median of rounds of blocks),
and the same graphs are lowered and simulated with per-op costs measured on this machine:
profiled in context once per timed block (interleaved: the same machine conditions) and, for
comparison, profiled after the measurement.
A full-size configuration whose single step takes longer than --max-step-s is replaced by
its tiny configuration (marked in the table). Writes JSON, a markdown table and a PNG.

    python benchmarks/fidelity.py --out benchmarks/results/fidelity_cpu_<date>
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import statistics
import sys
import time

import torch

import fxdream
from fxdream import models
from fxdream.ab import interleaved_profiler
from fxdream.build import cost_model_for
from fxdream.capturing.host_gaps import StepCalls, measure_host_gaps, worth_measuring
from fxdream.capturing.model_state import preserved_state
from fxdream.measure import time_interleaved
from fxdream.sim.prediction import predict


def step_of(module, inputs, training):
    """Inference: forward under no_grad. Training: forward + backward of the captured graphs
    (the output's gradient is given, so no eager loss runs outside what is simulated)."""
    if not training:
        def infer():
            with torch.no_grad():
                module(*inputs)
        return infer
    output_grad = torch.ones_like(module(*inputs))
    module.zero_grad(set_to_none=True)

    def train():
        for p in module.parameters():
            p.grad = None
        module(*inputs).backward(output_grad)
    return train


def one_row(name: str, batch: int, training: bool, max_step_s: float, rounds: int, cost) -> dict:
    tiny = False
    model, inputs, _ = models.build(name, batch)
    model.train(training)
    optimized = fxdream.optimize(model, inputs, training=training)
    step = step_of(optimized, inputs, training)
    started = time.perf_counter()
    step()
    if time.perf_counter() - started > max_step_s:
        tiny = True
        model, inputs, _ = models.build(name, batch, tiny=True)
        model.train(training)
        optimized = fxdream.optimize(model, inputs, training=training)
        step = step_of(optimized, inputs, training)
        started = time.perf_counter()
        step()
    once_s = time.perf_counter() - started
    block = max(1, min(20, int(0.25 / max(once_s, 1e-6))))
    # profiled once per timed block, beside the measurement; ``cost`` profiles after it
    profile, beside = interleaved_profiler(optimized.captured, block, None, "cpu")
    graphs = len(optimized.report.graphs)
    # host time outside the graphs (graph breaks, autograd), as optimize() and simulate() add
    # it; measured on one step per timed block, beside the measurement too
    step_samples = []
    calls = itertools.count()

    def profile_and_gaps():  # the gaps first: right after the timed block, as warm as it
        if worth_measuring(training, graphs) and next(calls) % block == 0:
            step_samples.append(measure_host_gaps(step, optimized._session.clock, rounds=1, warmup=0))
        profile()
    with preserved_state(model):
        measured = time_interleaved({"run": step, "profile": profile_and_gaps}, rounds=rounds, block=block,
                                    warmup=2, progress=False)["run"]
    measured_step = StepCalls.median(step_samples) if step_samples else None
    prediction = predict(optimized.captured, beside, training, step=measured_step)
    after = predict(optimized.captured, cost, training, step=measured_step)
    without_gaps = predict(optimized.captured, beside, training)
    return dict(model=name, batch=batch, training=training, tiny=tiny, subgraphs=graphs,
                graph_breaks=len(optimized.report.graph_breaks), capture=optimized.report.capture,
                host_gaps_ms=measured_step.total_us / 1e3 if measured_step else 0.0,
                predicted_without_gaps_ms=without_gaps.time_ms,
                error_without_gaps_pct=100 * (without_gaps.time_ms / measured.median_ms - 1),
                measured_ms=measured.median_ms, spread_pct=measured.spread_pct,
                predicted_ms=prediction.time_ms, error_pct=100 * (prediction.time_ms / measured.median_ms - 1),
                predicted_after_ms=after.time_ms,
                error_after_pct=100 * (after.time_ms / measured.median_ms - 1),
                predicted_range_ms=prediction.time_ms_range,
                in_range=prediction.time_ms_range[0] <= measured.median_ms <= prediction.time_ms_range[1])


def to_markdown(rows: list[dict]) -> str:
    """Predicted from costs profiled interleaved with the measurement, and (after) once it ended."""
    lines = ["| model | batch | mode | config | subgraphs | measured ms | host gaps ms (measured) "
             "| predicted ms | error | error without host gaps | predicted after ms | error after |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['batch']} | {'train' if r['training'] else 'infer'} "
                     f"| {'tiny' if r['tiny'] else 'full'} | {r['subgraphs']} | {r['measured_ms']:.3f} "
                     f"| {r.get('host_gaps_ms', 0.0):.3f} | {r['predicted_ms']:.3f} | {r['error_pct']:+.1f} % "
                     f"| {r.get('error_without_gaps_pct', r['error_pct']):+.1f} % "
                     f"| {r['predicted_after_ms']:.3f} | {r['error_after_pct']:+.1f} % |")
    for key, label in (("error_pct", "interleaved"), ("error_without_gaps_pct", "interleaved, without host gaps"),
                       ("error_after_pct", "profiled after")):
        errors = [abs(r[key]) for r in rows if key in r]
        if errors:
            lines.append(f"\n{label}: mean |error| {statistics.mean(errors):.1f} %, max {max(errors):.1f} % "
                         f"over {len(rows)} rows")
    hits = [r["in_range"] for r in rows if "in_range" in r]
    if hits:
        lines.append(f"\ncoverage: the measured time inside the predicted range in {sum(hits)} of {len(hits)} "
                     f"rows ({100 * sum(hits) / len(hits):.0f} %)")
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    from fxdream.sim.trace import _figure_api
    Figure, Canvas = _figure_api()
    fig = Figure(figsize=(5, 5))
    Canvas(fig)
    ax = fig.subplots()
    for training, marker in ((False, "o"), (True, "^")):
        pts = [(r["measured_ms"], r["predicted_ms"]) for r in rows if r["training"] == training]
        if pts:
            ax.scatter(*zip(*pts), marker=marker, label="training step" if training else "inference")
    lo = min(min(r["measured_ms"], r["predicted_ms"]) for r in rows)
    hi = max(max(r["measured_ms"], r["predicted_ms"]) for r in rows)
    ax.plot([lo, hi], [lo, hi], color="gray", linewidth=1, label="y = x")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured ms")
    ax.set_ylabel("predicted ms (profiled)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(models.NAMES))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--modes", default="infer,train")
    parser.add_argument("--max-step-s", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=f"benchmarks/results/fidelity_cpu_{datetime.date.today().isoformat()}")
    args = parser.parse_args(argv)
    cost = cost_model_for("cpu", "profiled")
    rows, skipped = [], []
    cases = [(m, int(b), mode == "train") for m in args.models.split(",") for b in args.batches.split(",")
             for mode in args.modes.split(",")]
    for i, (name, batch, training) in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {name} bs{batch} {'train' if training else 'infer'} ...", end=" ", flush=True)
        try:
            row = one_row(name, batch, training, args.max_step_s, args.rounds, cost)
        except Exception as error:  # e.g. BatchNorm in training at batch 1: report, go on
            why = f"{type(error).__name__}: {str(error).splitlines()[0][:100]}"
            print(f"skipped ({why})")
            skipped.append(dict(model=name, batch=batch, training=training, reason=why))
            continue
        rows.append(row)
        print(f"measured {row['measured_ms']:.2f} ms, predicted {row['predicted_ms']:.2f} ms, "
              f"error {row['error_pct']:+.1f} %{' (tiny)' if row['tiny'] else ''}")
    table = to_markdown(rows)
    print(table)
    meta = dict(device="cpu", threads=torch.get_num_threads(), torch=torch.__version__,
                date=datetime.date.today().isoformat())
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta, rows=rows, skipped=skipped), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(table + "\n")
    if rows:
        plot(rows, args.out + ".png")
    print(f"wrote {args.out}.json/.md/.png")
    if cases and not rows:
        print("fidelity: every case was skipped", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
