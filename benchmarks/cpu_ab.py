"""CPU A/B: fxdream passes vs eager and the peers, measured side by side in one process.

Runners per (model, batch): eager; fxdream with --passes; fxdream with precision="bf16" (inference:
convolutions and matrix products in bf16, its deviation from float32 in the row); torch.compile
default (inductor);
torch.compile with inductor freezing (the recommended CPU inference mode);
torch.fx.experimental.optimization.optimize_for_inference; and the inference engines of
cpu_peers.py: ONNX Runtime, OpenVINO in f32 and at its default precision (optional packages:
``pip install '.[peers]'``; a missing one is skipped with a message). Each is built (build time
recorded) and built again ("rebuild": fxdream reuses the costs it measured, inductor its
caches), checked against eager, then all are timed interleaved (median of rounds of blocks).
fxdream's prediction for its own rows is put beside the measurement. With --training a
runner times a training step (forward, loss, backward); freezing and optimize_for_inference
are inference-only and are listed as such.

    python benchmarks/cpu_ab.py --models resnet50 --batches 1,8 --out benchmarks/results/cpu_ab_<date>
    python benchmarks/cpu_ab.py --models resnet18,mnist_convnet --batches 1,8,32 --training
    python benchmarks/cpu_ab.py --models benchmarks/audio_like.py:build --batches 1,8   (your own model)
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
from fxdream.ab import PROFILING, interleaved_profiler, measured_step, step_fn
from fxdream.capturing.steps import one_step
from fxdream.cli_arguments import build_model
from fxdream.measure import time_interleaved
from fxdream.numerics import max_abs_diff
from fxdream.sim.prediction import predict

from cpu_peers import PEERS as ENGINES  # isort: skip (benchmarks/ is on the path when run as a script)
from cpu_peers import PeerUnavailable, build_peer  # isort: skip

PEERS = ("eager", "fxdream", "fxdream_bf16", "inductor", "inductor_freezing", "optimize_for_inference", *ENGINES)
INFERENCE_ONLY = ("fxdream_bf16", "inductor_freezing", "optimize_for_inference", *ENGINES)


def _build_runner(name: str, model, inputs, passes, training: bool = False):
    """(callable, build seconds, report or None) for one runner."""
    started = time.perf_counter()
    report = None
    if name == "eager":
        fn = model
    elif name in ("fxdream", "fxdream_bf16"):
        precision = "bf16" if name == "fxdream_bf16" else "fp32"
        fn = fxdream.optimize(model, inputs, passes=passes, training=training, precision=precision)
        report = fn.report
    elif name in ("inductor", "inductor_freezing"):
        fn = compile_inductor(model, inputs, freezing=name == "inductor_freezing", training=training)
    elif name == "optimize_for_inference":
        from torch.fx.experimental.optimization import optimize_for_inference
        fn = optimize_for_inference(copy.deepcopy(model))
    elif name in ENGINES:
        fn = build_peer(name, model, inputs)
    else:
        raise ValueError(f"unknown runner {name!r}; valid: {', '.join(PEERS)}")
    return fn, time.perf_counter() - started, report


PEER_RECOMPILE_LIMIT = 256  # dynamo's limit while peers compile: each copy is a cache entry of its own

def compile_inductor(model, inputs, freezing: bool, training: bool = False):
    """torch.compile (inductor) of a copy of ``model``, compiled now, with or without freezing.

    No torch._dynamo.reset() (it drops every compiled runner built before, fxdream's included),
    and a backend object of its own: dynamo lets compiled copies of one class share a cache
    entry when the backend is the same (a freezing copy built after a plain one ran the plain
    graph). Freezing is patched around the compile (options={"freezing": True} did not freeze).
    Every copy adds cache entries to the class's forward: past dynamo's recompile limit (8) it
    ran the copy eagerly, silently (a 3-batch run timed "inductor" at bs32 as eager), so the
    limit is raised, and a compile that produced no graph is an error, not a row.
    """
    import torch._inductor.config as inductor_config
    from torch._dynamo.utils import counters
    from torch._inductor.compile_fx import compile_fx

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, PEER_RECOMPILE_LIMIT)
    compiled = []

    def inductor(gm, example_inputs):
        compiled.append(gm)
        return compile_fx(gm, example_inputs)
    with inductor_config.patch(freezing=freezing):
        fn = torch.compile(copy.deepcopy(model), backend=inductor)
        one_step(fn, inputs, training)  # compiles now (forward and, in training, backward)
    if not compiled:
        raise RuntimeError(f"dynamo compiled no graph (it ran the model eagerly; "
                           f"recompiles: {dict(counters['recompiles'])})")
    return fn


def run_case(model_name: str, batch: int, runners: list[str], passes, rounds: int, block: int,
             rebuild: bool = True, training: bool = False) -> dict:
    model, inputs, loss_fn = build_model(model_name, batch, training=training)  # zoo or FILE.py:FUNCTION
    built, rows = {}, {}
    for name in runners:
        if training and name in INFERENCE_ONLY:
            rows[name] = dict(error="inference only")
            continue
        try:
            fn, seconds, report = _build_runner(name, model, inputs, passes, training)
            diff = max_abs_diff(model, fn, inputs, training, loss_fn)
        except PeerUnavailable as missing:
            print(f"  {name}: skipped, {missing}", flush=True)
            rows[name] = dict(error=str(missing))
            continue
        except Exception as error:  # a peer that cannot build here is reported, not fatal
            rows[name] = dict(error=f"{type(error).__name__}: {str(error).splitlines()[0][:160]}")
            continue
        built[name] = fn
        rows[name] = dict(build_s=seconds, max_abs_diff=diff)
        if hasattr(fn, "inference_precision"):
            rows[name]["precision"] = fn.inference_precision
        if rebuild and name != "eager":  # warm: fxdream reuses its measured costs, inductor its caches
            rows[name]["rebuild_s"] = _build_runner(name, model, inputs, passes, training)[1]
        if report is not None:
            rows[name].update(predicted_baseline_ms=report.predicted_baseline_ms,
                              predicted_ms=report.predicted_optimized_ms,
                              passes=[f"{p.name}: {p.reason}" for p in report.passes],
                              ran_eagerly=bool(report.ran_eagerly))  # auto's eager check found it slower
            if report.precision_deviation is not None:
                rows[name].update(precision=report.precision, deviation=report.precision_deviation.describe())

    runners = {n: step_fn(fn, inputs, loss_fn, training) for n, fn in built.items()}
    fast = built.get("fxdream")
    if fast is not None:
        runners[PROFILING], cost = interleaved_profiler(fast.captured, block, fast.rewritten_graphs, "cpu")
        step = measured_step(fast, model, inputs, loss_fn, training, cost)
    times = time_interleaved(runners, rounds=rounds, block=block, desc=f"{model_name} bs{batch}")
    times.pop(PROFILING, None)
    if fast is not None:
        rows["fxdream"].update(
            predicted_interleaved_baseline_ms=predict(fast.captured, cost, training, step=step).time_ms,
            predicted_interleaved_ms=predict(fast.captured, cost, training, graphs=fast.rewritten_graphs,
                                             step=step).time_ms)
    eager_ms = times["eager"].median_ms if "eager" in times else None
    for name, m in times.items():
        rows[name].update(median_ms=m.median_ms, spread_pct=m.spread_pct,
                          speedup_vs_eager=(eager_ms / m.median_ms) if eager_ms else None)
    return dict(model=model_name, batch=batch, training=training, runners=rows)


def to_markdown(cases: list[dict]) -> str:
    """Predicted at build time, and from costs profiled interleaved with the timed rounds."""
    lines = ["| model | batch | mode | runner | ms (measured) | vs eager | build s | rebuild s "
             "| predicted ms (build) | predicted ms (interleaved) | max abs diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in cases:
        head = f"| {case['model']} | {case['batch']} | {'train' if case.get('training') else 'infer'}"
        for name, r in case["runners"].items():
            if "error" in r:
                lines.append(f"{head} | {name} | not run: {r['error']} | | | | | | |")
                continue
            rebuild = f"{r['rebuild_s']:.1f}" if "rebuild_s" in r else "–"
            speedup = f"{r['speedup_vs_eager']:.2f}x" if r.get("speedup_vs_eager") else "–"
            preds = [f"{r[k]:.2f} ({100 * (r[k] / r['median_ms'] - 1):+.1f} %)" if r.get(k) else "–"
                     for k in ("predicted_ms", "predicted_interleaved_ms")]
            label = f"{name} (runs eagerly: eager check)" if r.get("ran_eagerly") else name
            label += f" ({r['precision']})" if r.get("precision") else ""
            lines.append(f"{head} | {label} | {r['median_ms']:.2f} | {speedup} | {r['build_s']:.1f} | {rebuild} "
                         f"| {preds[0]} | {preds[1]} | {r['max_abs_diff']:.1e} |")
    return "\n".join(lines)


def _short(model: str) -> str:
    """A zoo name as it is; ``benchmarks/hf_models.py:bert`` as ``hf_models:bert``."""
    where, colon, function = model.rpartition(":")
    return f"{where.rsplit('/', 1)[-1].removesuffix('.py')}:{function}" if colon else model


def plot(cases: list[dict], path: str) -> None:
    """Speed-up over eager per runner, grouped by (model, batch, mode)."""
    from fxdream.sim.trace import _figure_api
    Figure, Canvas = _figure_api()
    names = [n for n in PEERS if n != "eager" and any("speedup_vs_eager" in c["runners"].get(n, {}) for c in cases)]
    width = 0.8 / max(1, len(names))
    fig = Figure(figsize=(max(4, 1.6 * len(cases)), 3.5))
    Canvas(fig)
    ax = fig.subplots()
    top = 1.0
    for i, name in enumerate(names):
        ys = [c["runners"].get(name, {}).get("speedup_vs_eager") or 0 for c in cases]
        top = max(top, *ys)
        ax.bar([x + (i - (len(names) - 1) / 2) * width for x in range(len(cases))], ys, width, label=name)
    ax.axhline(1, color="black", linewidth=0.8)
    labels = [f"{_short(c['model'])}\nbs{c['batch']} {'train' if c.get('training') else 'infer'}" for c in cases]
    ax.set_xticks(range(len(cases)), labels)
    ax.set_ylabel("speed-up over eager (measured)")
    ax.set_ylim(0, top * 1.3)  # room for the legend above the bars
    ax.legend(fontsize=7, ncol=2, loc="upper center")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def cpu_name() -> str:
    """The CPU's model name as Linux reports it ("" elsewhere): results differ by CPU."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        return ""


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="resnet50")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--runners", default=",".join(PEERS))
    parser.add_argument("--passes", default="fuse_conv_bias_act")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--no-rebuild", action="store_true", help="skip timing a second build of each runner")
    parser.add_argument("--training", action="store_true", help="time training steps (inference-only peers skipped)")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG (it needs matplotlib)")
    parser.add_argument("--out", default=f"benchmarks/results/cpu_ab_{datetime.date.today().isoformat()}")
    args = parser.parse_args(argv)
    unknown = [name for name in args.runners.split(",") if name not in PEERS]
    if unknown:
        parser.error(f"unknown runner(s) {', '.join(unknown)}; valid: {', '.join(PEERS)}")
    passes = "auto" if args.passes == "auto" else [p for p in args.passes.split(",") if p]
    cases = []
    for model_name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            print(f"{model_name} bs{batch}: building {args.runners} ...", flush=True)
            cases.append(run_case(model_name, batch, args.runners.split(","), passes, args.rounds, args.block,
                                  rebuild=not args.no_rebuild, training=args.training))
            print(to_markdown(cases[-1:]), flush=True)
    table = to_markdown(cases)
    meta = dict(device="cpu", cpu=cpu_name(), cpu_capability=torch.backends.cpu.get_cpu_capability(),
                threads=torch.get_num_threads(), torch=torch.__version__,
                date=datetime.date.today().isoformat(), passes=args.passes)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(meta, cases=cases), f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(table + "\n")
    print(table)
    written = [".json", ".md"]
    if not args.no_plot:
        plot(cases, args.out + ".png")
        written.append(".png")
    print(f"wrote {args.out}{', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
