"""The numbers a build report gives, against the same modules measured side by side right after.

For each zoo model × batch × {inference, training step}: ``optimize(passes="auto")`` is built
(its report's predicted time for the capture without passes and for the optimized module, with
their ranges, all from the build's own in-context timing), and the capture without passes is
built beside it. Then both modules and eager are timed interleaved in one process. Per row:
the error of each predicted time, of the predicted gain (auto over no passes), and whether the
measured time (and gain) fell inside the predicted range. A full-size configuration whose step
takes longer than --max-step-s is replaced by its tiny configuration (marked).

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


def _built(name: str, batch: int, training: bool, max_step_s: float, device: str, dtype: str):
    """(model, inputs, auto-built module, build seconds, tiny?): the full size unless a step of
    it takes longer than ``max_step_s``."""
    for tiny in (False, True):
        model, inputs, _ = models.build(name, batch, tiny=tiny, device=device, dtype=DTYPES[dtype])
        model.train(training)
        started = time.perf_counter()
        with torch.no_grad() if not training else torch.enable_grad():
            model(*inputs)
        if device != "cpu":
            torch.cuda.synchronize()
        if time.perf_counter() - started <= max_step_s or tiny:
            started = time.perf_counter()
            # no eager check: the module runs the graphs its report predicts, even where slower
            optimized = fxdream.optimize(model, inputs, passes="auto", training=training, eager_check=False)
            return model, inputs, optimized, time.perf_counter() - started, tiny
    raise AssertionError("unreachable")


def _inside(value: float, bounds) -> bool:
    return bounds is not None and bounds[0] <= value <= bounds[1]


def one_row(name: str, batch: int, training: bool, max_step_s: float, rounds: int, device: str = "cpu",
            dtype: str = "fp32") -> dict:
    model, inputs, optimized, build_s, tiny = _built(name, batch, training, max_step_s, device, dtype)
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
               chosen=[r.name for r in report.passes if r.applied and r.name != "auto"],
               ran_eagerly=report.fallback_reason is not None, measured_eager_ms=measured["eager"].median_ms,
               measured_baseline_ms=base_ms, measured_optimized_ms=auto_ms,
               measured_baseline_min_ms=measured["no passes"].min_ms, measured_optimized_min_ms=measured["auto"].min_ms,
               measured_gain=base_ms / auto_ms, disturbed=report.measurements_disturbed)
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
    return row


def summary(rows: list[dict]) -> list[str]:
    lines = []
    for mode in ("infer", "train", "all"):
        chosen = [r for r in rows if "optimized_error_pct" in r
                  and (mode == "all" or r["training"] == (mode == "train"))]
        if not chosen:
            continue
        for what in ("optimized", "gain", "baseline"):
            errors = [abs(r[f"{what}_error_pct"]) for r in chosen]
            inside = (f", measured inside the range {sum(r[f'{what}_in_range'] for r in chosen)}/{len(chosen)}"
                      if f"{what}_in_range" in chosen[0] else "")
            lines.append(f"{mode}: {what} prediction mean |error| {statistics.mean(errors):.1f} %, "
                         f"max {max(errors):.1f} % over {len(chosen)} rows{inside}")
    return lines


def to_markdown(rows: list[dict]) -> str:
    head = ("| model | batch | mode | config | build s | chosen | measured no passes ms | predicted ms (range) | "
            "measured auto ms | predicted ms (range) | error | measured gain | predicted gain (range) | "
            "gain error |\n" + "|---" * 14 + "|\n")
    body = []
    for r in rows:
        mode, config = ("train" if r["training"] else "infer"), ("tiny" if r["tiny"] else "full")
        if "optimized_error_pct" not in r:
            body.append(f"| {r['model']} | {r['batch']} | {mode} | {config} | {r['build_s']:.1f} | "
                        f"{'+'.join(r['chosen']) or 'none'} | {r['measured_baseline_ms']:.3f} | – | "
                        f"{r['measured_optimized_ms']:.3f} | – | – | {r['measured_gain']:.2f}x | – | – |")
            continue
        b, a, g = r["predicted_baseline_range_ms"], r["predicted_optimized_range_ms"], r["predicted_gain_range"]
        body.append(
            f"| {r['model']} | {r['batch']} | {mode} | {config} | {r['build_s']:.1f} | "
            f"{'+'.join(r['chosen']) or 'none'} | {r['measured_baseline_ms']:.3f} | "
            f"{r['predicted_baseline_ms']:.3f} ({b[0]:.3f}–{b[1]:.3f}) | "
            f"{r['measured_optimized_ms']:.3f} | {r['predicted_optimized_ms']:.3f} ({a[0]:.3f}–{a[1]:.3f}) | "
            f"{r['optimized_error_pct']:+.1f} % | {r['measured_gain']:.2f}x | {r['predicted_gain']:.2f}x "
            f"({g[0]:.2f}–{g[1]:.2f}) | {r['gain_error_pct']:+.1f} % |")
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
