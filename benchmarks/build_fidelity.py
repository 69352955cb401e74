"""The numbers a build report gives, against the same modules measured side by side right after.

For each zoo model × batch × {inference, training step}: ``optimize(passes="auto")`` is built
(its report's predicted time for the capture without passes and for the optimized module, with
their ranges, all from the build's own in-context timing), and the capture without passes is
built beside it. Then both modules and eager are timed interleaved in one process. Per row:
the error of each predicted time, of the predicted gain (auto over no passes), and whether the
measured time (and gain) fell inside the predicted range. A full-size configuration whose step
takes longer than --max-step-s is replaced by its tiny configuration (marked).

The machine's drift: eager is timed right before and right after the build, and again in the
interleaved measurement; their ratio says how much faster or slower the machine ran when the
modules were measured than while the build timed them. The optimized module's error at the
build's speed (its prediction times that ratio) separates the prediction's own error from it.

    python benchmarks/build_fidelity.py --out benchmarks/results/build_fidelity_cpu_<date>
    python benchmarks/build_fidelity.py --device cuda --dtype fp16 --out out/build_fidelity_gpu
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch

import fxdream
from fxdream import models
from fxdream.capturing.model_state import preserved_state
from fxdream.measure import time_interleaved

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fidelity import step_of  # noqa: E402  (the same step, forward or forward and backward)
from zoo_cases import DTYPES, device_name, run_cases  # noqa: E402


def _eager_ms(model, inputs, training: bool, device: str, seconds: float = 0.3) -> float:
    """Median eager step over ``seconds`` (at least three steps): the machine's speed now."""
    step, times = step_of(model, inputs, training), []
    with preserved_state(model):
        began = time.perf_counter()
        while len(times) < 3 or time.perf_counter() - began < seconds:
            started = time.perf_counter()
            step()
            if device != "cpu":
                torch.cuda.synchronize()
            times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def _built(name: str, batch: int, training: bool, max_step_s: float, device: str, dtype: str):
    """(model, inputs, auto-built module, build seconds, tiny?, eager ms around the build): the
    full size unless a step of it takes longer than ``max_step_s``. Eager steps timed right
    before and right after the build tell how fast the machine ran while the build measured."""
    for tiny in (False, True):
        model, inputs, _ = models.build(name, batch, tiny=tiny, device=device, dtype=DTYPES[dtype])
        model.train(training)
        started = time.perf_counter()
        with torch.no_grad() if not training else torch.enable_grad():
            model(*inputs)
        if device != "cpu":
            torch.cuda.synchronize()
        if time.perf_counter() - started <= max_step_s or tiny:
            before = _eager_ms(model, inputs, training, device)
            started = time.perf_counter()
            # no eager check: the module runs the graphs its report predicts, even where slower
            optimized = fxdream.optimize(model, inputs, passes="auto", training=training, eager_check=False)
            build_s = time.perf_counter() - started
            around = (before + _eager_ms(model, inputs, training, device)) / 2
            return model, inputs, optimized, build_s, tiny, around
    raise AssertionError("unreachable")


def _inside(value: float, bounds) -> bool:
    return bounds is not None and bounds[0] <= value <= bounds[1]


def one_row(name: str, batch: int, training: bool, max_step_s: float, rounds: int, device: str = "cpu",
            dtype: str = "fp32") -> dict:
    model, inputs, optimized, build_s, tiny, eager_around_build_ms = _built(name, batch, training, max_step_s,
                                                                           device, dtype)
    report = optimized.report
    baseline = fxdream.optimize(model, inputs, training=training)  # the capture without passes
    runners = {"eager": step_of(model, inputs, training), "no passes": step_of(baseline, inputs, training),
               "auto": step_of(optimized, inputs, training)}
    started = time.perf_counter()
    runners["auto"]()
    block = max(1, min(10, int(0.2 / max(time.perf_counter() - started, 1e-6))))
    with preserved_state(model):
        measured = time_interleaved(runners, rounds=rounds, block=block, warmup=2, progress=False)
    base_ms, auto_ms = measured["no passes"].median_ms, measured["auto"].median_ms
    row = dict(model=name, batch=batch, training=training, tiny=tiny, device=device, dtype=dtype, build_s=build_s,
               capture=report.capture, subgraphs=len(report.graphs), graph_breaks=len(report.graph_breaks),
               chosen=list(dict.fromkeys(r.name for r in report.passes if r.applied and r.name != "auto")),
               # each pass row's verdict and reason: why a pass was or was not chosen, read after the run
               pass_rows=[dict(name=r.name, phase=r.phase, applied=r.applied, reason=r.reason[:400])
                          for r in report.passes],
               ran_eagerly=report.fallback_reason is not None, measured_eager_ms=measured["eager"].median_ms,
               measured_baseline_ms=base_ms, measured_optimized_ms=auto_ms,
               measured_baseline_min_ms=measured["no passes"].min_ms, measured_optimized_min_ms=measured["auto"].min_ms,
               measured_gain=base_ms / auto_ms, disturbed=report.measurements_disturbed,
               page_faults_per_call={name: m.page_faults_per_call for name, m in measured.items()},
               eager_around_build_ms=eager_around_build_ms)
    predicted_base, predicted_auto = report.predicted_baseline_ms, report.predicted_optimized_ms
    if predicted_base is None or predicted_auto is None:
        return row
    base_range, auto_range = report.predicted_baseline_ms_range, report.predicted_optimized_ms_range
    gain_range = report.predicted_speedup_range
    row.update(predicted_baseline_ms=predicted_base, predicted_optimized_ms=predicted_auto,
               predicted_baseline_range_ms=base_range, predicted_optimized_range_ms=auto_range,
               predicted_gain=predicted_base / predicted_auto, predicted_gain_range=gain_range,
               baseline_error_pct=100 * (predicted_base / base_ms - 1),
               optimized_error_pct=100 * (predicted_auto / auto_ms - 1),
               gain_error_pct=100 * ((predicted_base / predicted_auto) / (base_ms / auto_ms) - 1),
               optimized_in_range=_inside(auto_ms, auto_range), gain_in_range=_inside(base_ms / auto_ms, gain_range))
    # the machine's drift between the build and the measurement, read on eager: the error the
    # prediction would have had, had the machine run at the build's speed when measured
    drift = row["measured_eager_ms"] / eager_around_build_ms
    row.update(machine_drift=drift, optimized_error_at_build_speed_pct=100 * (predicted_auto * drift / auto_ms - 1))
    return row


# (what the line says, the row's error key, the row's in-range key or None)
_SUMMARIES = (("optimized prediction", "optimized_error_pct", "optimized_in_range"),
              ("gain prediction", "gain_error_pct", "gain_in_range"),
              ("baseline prediction", "baseline_error_pct", None),
              ("optimized prediction at the build's machine speed", "optimized_error_at_build_speed_pct", None))


def summary(rows: list[dict]) -> list[str]:
    lines = []
    for mode in ("infer", "train", "all"):
        chosen = [r for r in rows if "optimized_error_pct" in r
                  and (mode == "all" or r["training"] == (mode == "train"))]
        for label, key, in_range in _SUMMARIES:
            if not chosen or not all(key in r for r in chosen):
                continue
            errors = [abs(r[key]) for r in chosen]
            inside = f", measured inside the range {sum(r[in_range] for r in chosen)}/{len(chosen)}" if in_range else ""
            lines.append(f"{mode}: {label} mean |error| {statistics.mean(errors):.1f} %, "
                         f"max {max(errors):.1f} % over {len(chosen)} rows{inside}")
    return lines


def _drift(row: dict) -> str:
    """Eager measured after the build over eager around it (older results have no such column)."""
    return f"{row['machine_drift']:.2f}x" if "machine_drift" in row else "–"


def to_markdown(rows: list[dict]) -> str:
    head = ("| model | batch | mode | config | build s | chosen | measured no passes ms | predicted ms (range) | "
            "measured auto ms | predicted ms (range) | error | measured gain | predicted gain (range) | "
            "gain error | machine drift |\n" + "|---" * 15 + "|\n")
    body = []
    for r in rows:
        mode, config = ("train" if r["training"] else "infer"), ("tiny" if r["tiny"] else "full")
        if "optimized_error_pct" not in r:
            body.append(f"| {r['model']} | {r['batch']} | {mode} | {config} | {r['build_s']:.1f} | "
                        f"{'+'.join(r['chosen']) or 'none'} | {r['measured_baseline_ms']:.3f} | – | "
                        f"{r['measured_optimized_ms']:.3f} | – | – | {r['measured_gain']:.2f}x | – | – | – |")
            continue
        b, a, g = r["predicted_baseline_range_ms"], r["predicted_optimized_range_ms"], r["predicted_gain_range"]
        body.append(
            f"| {r['model']} | {r['batch']} | {mode} | {config} | {r['build_s']:.1f} | "
            f"{'+'.join(r['chosen']) or 'none'} | {r['measured_baseline_ms']:.3f} | "
            f"{r['predicted_baseline_ms']:.3f} ({b[0]:.3f}–{b[1]:.3f}) | "
            f"{r['measured_optimized_ms']:.3f} | {r['predicted_optimized_ms']:.3f} ({a[0]:.3f}–{a[1]:.3f}) | "
            f"{r['optimized_error_pct']:+.1f} % | {r['measured_gain']:.2f}x | {r['predicted_gain']:.2f}x "
            f"({g[0]:.2f}–{g[1]:.2f}) | {r['gain_error_pct']:+.1f} % | {_drift(r)} |")
    return head + "\n".join(body) + "\n\n" + "\n\n".join(summary(rows)) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(models.NAMES))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--modes", default="infer,train")
    parser.add_argument("--max-step-s", type=float, default=0.5)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (this GPU, profiled costs)")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--out", default=f"benchmarks/results/build_fidelity_cpu_{datetime.date.today().isoformat()}")
    args = parser.parse_args(argv)
    def after_row(row):
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}),
              file=sys.stderr, flush=True)
    rows = run_cases(args.models, args.batches, args.modes,
                     lambda name, batch, training: one_row(name, batch, training, args.max_step_s, args.rounds,
                                                           args.device, args.dtype),
                     args.out, {"torch": torch.__version__, "device": device_name(args.device),
                                "threads": torch.get_num_threads()}, to_markdown, after_row)
    print(to_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
