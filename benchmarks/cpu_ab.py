"""CPU A/B: fxdream passes vs eager and the peers, measured side by side in one process.

Runners per (model, batch): eager; fxdream with --passes; torch.compile default (inductor);
torch.compile with inductor freezing (the recommended CPU inference mode); and
torch.fx.experimental.optimization.optimize_for_inference. Each is built (build time
recorded) and built again ("rebuild": fxdream reuses the costs it measured, inductor its
caches), checked against eager, then all are timed interleaved (median of rounds of blocks).
fxdream's prediction for its own rows is put beside the measurement.

    python benchmarks/cpu_ab.py --models resnet50 --batches 1,8 --out benchmarks/results/cpu_ab_<date>
"""
from __future__ import annotations

import argparse
import copy
import datetime
import json
import sys
import time

import torch

import fxdream
from fxdream import models
from fxdream.ab import PROFILING, interleaved_profiler
from fxdream.measure import time_interleaved
from fxdream.predict import predict

PEERS = ("eager", "fxdream", "inductor", "inductor_freezing", "optimize_for_inference")


def _build_runner(name: str, model, inputs, passes):
    """(callable, build seconds, report or None) for one runner, inference under no_grad."""
    started = time.perf_counter()
    report = None
    if name == "eager":
        fn = model
    elif name == "fxdream":
        fn = fxdream.optimize(model, inputs, passes=passes)
        report = fn.report
    elif name in ("inductor", "inductor_freezing"):
        fn = compile_inductor(model, inputs, freezing=name == "inductor_freezing")
    elif name == "optimize_for_inference":
        from torch.fx.experimental.optimization import optimize_for_inference
        fn = optimize_for_inference(copy.deepcopy(model))
    else:
        raise ValueError(f"unknown runner {name!r}; valid: {', '.join(PEERS)}")
    return fn, time.perf_counter() - started, report


def compile_inductor(model, inputs, freezing: bool):
    """torch.compile (inductor) of a copy of ``model``, compiled now, with or without freezing.

    No torch._dynamo.reset() (it drops every compiled runner built before, fxdream's included),
    and a backend object of its own: dynamo lets compiled copies of one class share a cache
    entry when the backend is the same (a freezing copy built after a plain one ran the plain
    graph). Freezing is patched around the compile (options={"freezing": True} did not freeze).
    """
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx

    def inductor(gm, example_inputs):
        return compile_fx(gm, example_inputs)
    with inductor_config.patch(freezing=freezing):
        fn = torch.compile(copy.deepcopy(model), backend=inductor)
        with torch.no_grad():
            fn(*inputs)
    return fn


def run_case(model_name: str, batch: int, runners: list[str], passes, rounds: int, block: int,
             rebuild: bool = True) -> dict:
    model, inputs, _ = models.build(model_name, batch)
    model.eval()
    with torch.no_grad():
        expected = model(*inputs)
    built, rows = {}, {}
    for name in runners:
        try:
            fn, seconds, report = _build_runner(name, model, inputs, passes)
            with torch.no_grad():
                diff = (fn(*inputs) - expected).abs().max().item()
        except Exception as error:  # a peer that cannot build here is reported, not fatal
            rows[name] = dict(error=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
            continue
        built[name] = fn
        rows[name] = dict(build_s=seconds, max_abs_diff=diff)
        if rebuild and name != "eager":  # warm: fxdream reuses its measured costs, inductor its caches
            rows[name]["rebuild_s"] = _build_runner(name, model, inputs, passes)[1]
        if report is not None:
            rows[name].update(predicted_baseline_ms=report.predicted_baseline_ms,
                              predicted_ms=report.predicted_optimized_ms,
                              passes=[f"{p.name}: {p.reason}" for p in report.passes])

    def call(fn):
        def run():
            with torch.no_grad():
                fn(*inputs)
        return run
    runners = {n: call(fn) for n, fn in built.items()}
    fast = built.get("fxdream")
    if fast is not None:
        runners[PROFILING], cost = interleaved_profiler(fast.captured, block, fast.rewritten_graphs, "cpu")
    times = time_interleaved(runners, rounds=rounds, block=block, desc=f"{model_name} bs{batch}")
    times.pop(PROFILING, None)
    if fast is not None:
        rows["fxdream"].update(
            predicted_interleaved_baseline_ms=predict(fast.captured, cost, False).time_ms,
            predicted_interleaved_ms=predict(fast.captured, cost, False, graphs=fast.rewritten_graphs).time_ms)
    eager_ms = times["eager"].median_ms if "eager" in times else None
    for name, m in times.items():
        rows[name].update(median_ms=m.median_ms, spread_pct=m.spread_pct,
                          speedup_vs_eager=(eager_ms / m.median_ms) if eager_ms else None)
    return dict(model=model_name, batch=batch, runners=rows)


def to_markdown(cases: list[dict]) -> str:
    """Predicted at build time, and from costs profiled interleaved with the timed rounds."""
    lines = ["| model | batch | runner | ms (measured) | vs eager | build s | rebuild s | predicted ms (build) "
             "| predicted ms (interleaved) | max abs diff |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for case in cases:
        for name, r in case["runners"].items():
            if "error" in r:
                lines.append(f"| {case['model']} | {case['batch']} | {name} | failed: {r['error']} | | | | | | |")
                continue
            rebuild = f"{r['rebuild_s']:.1f}" if "rebuild_s" in r else "–"
            preds = [f"{r[k]:.2f} ({100 * (r[k] / r['median_ms'] - 1):+.1f} %)" if r.get(k) else "–"
                     for k in ("predicted_ms", "predicted_interleaved_ms")]
            lines.append(f"| {case['model']} | {case['batch']} | {name} | {r['median_ms']:.2f} "
                         f"| {r['speedup_vs_eager']:.2f}x | {r['build_s']:.1f} | {rebuild} | {preds[0]} | {preds[1]} "
                         f"| {r['max_abs_diff']:.1e} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet50")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--runners", default=",".join(PEERS))
    parser.add_argument("--passes", default="fuse_conv_bias_act")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--no-rebuild", action="store_true", help="skip timing a second build of each runner")
    parser.add_argument("--out", default=f"benchmarks/results/cpu_ab_{datetime.date.today().isoformat()}")
    args = parser.parse_args(argv)
    passes = "auto" if args.passes == "auto" else [p for p in args.passes.split(",") if p]
    cases = []
    for model_name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            print(f"{model_name} bs{batch}: building {args.runners} ...", flush=True)
            cases.append(run_case(model_name, batch, args.runners.split(","), passes, args.rounds, args.block,
                                  rebuild=not args.no_rebuild))
            print(to_markdown(cases[-1:]), flush=True)
    table = to_markdown(cases)
    meta = dict(device="cpu", threads=torch.get_num_threads(), torch=torch.__version__,
                date=datetime.date.today().isoformat(), passes=args.passes)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta, cases=cases), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(table + "\n")
    print(table)
    print(f"wrote {args.out}.json and .md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
