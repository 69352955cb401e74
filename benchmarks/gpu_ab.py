"""GPU A/B: CUDA graphs by fxdream vs eager and torch.compile(mode="reduce-overhead"), in one run.

Runners per case (model, dtype, batch), inference under no_grad:
  eager             the model itself
  capture           fxdream's capture with no pass (what the predictions' "before" simulates)
  cuda_graphs       fxdream with the cuda_graphs pass
  fuse+cuda_graphs  fxdream with fuse_conv_bias_act then cuda_graphs (skipped if that pass is absent)
  reduce_overhead   torch.compile(mode="reduce-overhead"), the peer (inductor + CUDA graph trees)
Each is built once (build seconds recorded), checked against eager (max abs diff), then all are
timed interleaved (fxdream.measure.time_interleaved: median of rounds of blocks). fxdream's
predictions (Profiled on this GPU, plus the analytic model of this GPU's DeviceSpec) sit beside
its measurements. A first section measures the per-call overhead of the runner on a tiny graph
(3 one-element ops) against reduce-overhead's and against a bare CUDAGraph.replay().

Models: by default the zoo's resnet50 and bert_base (fxdream.models; any zoo model by name),
torchvision's resnet50 and a transformers BertModel (random weights from their default configs;
skipped if not importable).
Cases run bs1 first, then bs128, 8, 32 (the seed's two points first), and stop when
--budget-s is spent (the rest is listed as skipped), so a run fits a device lease. The
peer's compile dominates the time, so by default it is built for the zoo's ResNet-50 at
bs1 and bs128 only (--peer-models, --peer-batches). Results are written after each case.
Each case runs in a process of its own (``isolated.run_isolated``; ~5 s more a case): on an
H200 one case ended with a CUDA error, which leaves a process's CUDA context unusable, and
in one process the cases after it were lost (``--in-process`` runs them all in this one).

    python benchmarks/gpu_ab.py                       # ~5 min on an H200 (--budget-s)
    python benchmarks/gpu_ab.py --models resnet50 --batches 1 --dtypes fp16 --out $OUT/gpu_ab.json
"""
from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_overhead import runner_overhead  # noqa: E402
from hf_models import LastHidden  # noqa: E402
from isolated import run_isolated  # noqa: E402

import fxdream  # noqa: E402
from fxdream import models  # noqa: E402
from fxdream.measure import time_interleaved  # noqa: E402
from fxdream.runtime.cuda_graph_runner import cuda_graph_memory_bytes, describe_runners  # noqa: E402

RUNNERS = ("eager", "capture", "cuda_graphs", "fuse+cuda_graphs", "reduce_overhead")
MODELS = ("resnet50", "bert_base", "tv_resnet50", "hf_bert")  # the default --models
THIRD_PARTY = ("tv_resnet50", "hf_bert")  # written by torchvision / transformers
VALID_MODELS = tuple(models.NAMES) + THIRD_PARTY  # any zoo model by name (fxdream.models.NAMES), and those
DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
BATCH_ORDER = (1, 128, 8, 32)


def log(message: str) -> None:
    print(f"[gpu_ab {time.strftime('%H:%M:%S')}] {message}", flush=True)


# --- models ------------------------------------------------------------------------------------

def build_model(name: str, batch: int, dtype: torch.dtype):
    """(model in eval mode on cuda, inputs) or raises ImportError for a missing third-party package."""
    generator = torch.Generator().manual_seed(1)
    if name in models.NAMES:
        model, inputs, _ = models.build(name, batch, device="cuda", dtype=dtype)
        return model.eval(), inputs
    if name == "tv_resnet50":
        import torchvision
        torch.manual_seed(0)
        model = torchvision.models.resnet50(weights=None)
        x = torch.randn(batch, 3, 224, 224, generator=generator)
        return model.to("cuda", dtype).eval(), (x.to("cuda", dtype),)
    if name == "hf_bert":
        import transformers
        torch.manual_seed(0)
        config = transformers.BertConfig()  # bert-base-uncased's shape, random weights, no download
        model = transformers.BertModel(config)
        ids = torch.randint(1, config.vocab_size, (batch, 128), generator=generator)
        return LastHidden(model).to("cuda", dtype).eval(), (ids.to("cuda"),)
    raise ValueError(f"unknown model {name!r}; valid: {', '.join(VALID_MODELS)}")


# --- runners -----------------------------------------------------------------------------------

def _first_tensor(out):
    leaves = torch.utils._pytree.tree_leaves(out)
    return next(t for t in leaves if isinstance(t, torch.Tensor))


def build_runner(name: str, model, inputs, dtype):
    """(callable, build seconds, info dict). Raises if the runner cannot be built."""
    info: dict = {}
    started = time.perf_counter()
    if name == "eager":
        fn = model
    elif name in ("capture", "cuda_graphs", "fuse+cuda_graphs"):
        passes = {"capture": [], "cuda_graphs": ["cuda_graphs"],
                  "fuse+cuda_graphs": ["fuse_conv_bias_act", "cuda_graphs"]}[name]
        missing = [p for p in passes if p not in fxdream.available_passes()]
        if missing:
            raise LookupError(f"pass {', '.join(missing)} is not registered")
        fn = fxdream.optimize(model, inputs, passes=passes, cost="auto" if passes else None)
        report = fn.report
        info.update(fallback_reason=report.fallback_reason, graph_breaks=list(report.graph_breaks),
                    predicted_baseline_ms=report.predicted_baseline_ms,
                    predicted_optimized_ms=report.predicted_optimized_ms,
                    predicted_peak_delta_bytes=report.predicted_peak_delta_bytes,
                    passes=[dict(name=r.name, phase=r.phase, applied=r.applied, reason=r.reason,
                                 notes=list(r.notes[:12]), predicted_delta_us=r.predicted_delta_us,
                                 predicted_delta_peak_bytes=r.predicted_delta_peak_bytes)
                            for r in report.passes])
    elif name == "reduce_overhead":
        fn = torch.compile(copy.deepcopy(model), mode="reduce-overhead")
        with torch.no_grad():
            for _ in range(3):  # compile, warm up, record the CUDA graph
                fn(*inputs)
        torch.cuda.synchronize()
    else:
        raise ValueError(f"unknown runner {name!r}; valid: {', '.join(RUNNERS)}")
    return fn, time.perf_counter() - started, info


def _analytic_prediction(fn) -> dict:
    """The analytic model of this GPU on the captured forward graph (no measurement)."""
    from fxdream.passes.cuda_graphs import predict_cuda_graph_gain
    from fxdream.sim.prediction import this_machine_device
    device = this_machine_device("cuda")
    rows = []
    for captured in fn.captured:
        p = predict_cuda_graph_gain(captured, device)
        rows.append(dict(before_ms=p.before_us / 1e3, after_ms=p.after_us / 1e3, gain_pct=p.gain_pct,
                         regions=[r.describe() for r in p.regions]))
    return dict(device=device, graphs=rows)


def run_case(model_name: str, dtype_name: str, batch: int, runner_names, peer: bool, rounds: int, block: int) -> dict:
    dtype = DTYPES[dtype_name]
    case = dict(model=model_name, dtype=dtype_name, batch=batch, runners={}, skipped={})
    model, inputs = build_model(model_name, batch, dtype)
    with torch.no_grad():
        expected = _first_tensor(model(*inputs)).float()
    built = {}
    for name in runner_names:
        if name == "reduce_overhead" and not peer:
            case["skipped"][name] = "not for this model or batch (--peer-models, --peer-batches)"
            continue
        if name == "fuse+cuda_graphs" and "bert" in model_name:
            case["skipped"][name] = "no convolution to fuse (same graph as cuda_graphs)"
            continue
        try:
            fn, seconds, info = build_runner(name, model, inputs, dtype)
            with torch.no_grad():
                got = _first_tensor(fn(*inputs)).float()
            info.update(build_s=seconds, max_abs_diff=(got - expected).abs().max().item())
            if name in ("cuda_graphs", "fuse+cuda_graphs"):
                info.update(runners=list(describe_runners(fn)), graph_memory_bytes=cuda_graph_memory_bytes(fn))
                try:
                    info["analytic"] = _analytic_prediction(fn)
                except Exception as error:  # a prediction must never stop a measurement
                    info["analytic"] = f"failed: {type(error).__name__}: {error}"
            built[name] = fn
            case["runners"][name] = info
            log(f"  built {name:<17} in {seconds:6.1f} s, max |diff| {info['max_abs_diff']:.2e}")
        except Exception as error:
            case["skipped"][name] = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
            log(f"  skipped {name}: {case['skipped'][name]}")
            if not isinstance(error, LookupError):
                case.setdefault("tracebacks", {})[name] = traceback.format_exc(limit=6)

    def call(fn):
        def run():
            fn(*inputs)
        return run
    with torch.no_grad():
        times = time_interleaved({n: call(fn) for n, fn in built.items()}, rounds=rounds, block=block,
                                 progress=False, desc=f"{model_name} bs{batch}")
    eager_ms = times["eager"].median_ms if "eager" in times else None
    for name, m in times.items():
        row = case["runners"][name]
        row.update(median_ms=m.median_ms, min_ms=m.min_ms, max_ms=m.max_ms, rounds=m.rounds,
                   calls_per_round=m.calls_per_round, speedup_vs_eager=(eager_ms / m.median_ms) if eager_ms else None)
        if row.get("predicted_optimized_ms") is not None:
            row["predicted_error_pct"] = 100.0 * (row["predicted_optimized_ms"] / m.median_ms - 1.0)
        if name == "capture" or row.get("predicted_baseline_ms") is None:
            continue
        if "capture" in times:
            base = times["capture"].median_ms
            row["measured_gain_pct_vs_capture"] = 100.0 * (base / m.median_ms - 1.0)
            row["predicted_gain_pct"] = 100.0 * (row["predicted_baseline_ms"] / row["predicted_optimized_ms"] - 1.0)
            row["predicted_baseline_error_pct"] = 100.0 * (row["predicted_baseline_ms"] / base - 1.0)
    summary = ", ".join(f"{n} {case['runners'][n]['median_ms']:.3f} ms" for n in times)
    log(f"  measured: {summary}")
    del built, model
    _cleanup()
    return case


def _cleanup() -> None:
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


# --- main ----------------------------------------------------------------------------------------

def one_case(model_name, dtype_name, batch, runner_names, peer_models, peer_batches, args) -> tuple[str, dict]:
    """("case", its row) or ("skipped", why): a model that is not importable, or a failure."""
    try:
        peer = batch in peer_batches and model_name in peer_models
        return "case", run_case(model_name, dtype_name, batch, runner_names, peer, args.rounds, args.block)
    except ImportError as error:
        log(f"  skipped: {error}")
        return "skipped", dict(reason=f"not importable: {error}")
    except Exception as error:
        log(f"  failed: {type(error).__name__}: {error}")
        row = dict(reason=f"{type(error).__name__}: {error}", traceback=traceback.format_exc(limit=8))
        try:
            _cleanup()
        except Exception:  # noqa: BLE001  (a CUDA error leaves the context unusable: nothing to free)
            pass
        return "skipped", row


def plan_cases(model_names, dtypes, batches) -> list[tuple[str, str, int]]:
    """bs1 cases of every model first, then bs128, 8, 32; ResNet-50 in each dtype, the others in the first."""
    ordered_batches = [b for b in BATCH_ORDER if b in batches] + [b for b in batches if b not in BATCH_ORDER]
    cases = []
    for batch in ordered_batches:
        for dtype_index, dtype in enumerate(dtypes):
            for name in model_names:
                if dtype_index == 0 or name in ("resnet50", "tv_resnet50"):
                    cases.append((name, dtype, batch))
    seen, unique = set(), []
    for c in cases:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return unique


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--dtypes", default="fp16,fp32",
                        help="first dtype for every model; ResNet-50s also in the rest")
    parser.add_argument("--runners", default=",".join(RUNNERS))
    parser.add_argument("--peer-batches", default="1,128", help="batches at which reduce-overhead is built (its "
                        "compile takes most of the budget)")
    parser.add_argument("--peer-models", default="resnet50", help="models for which reduce-overhead is built")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--budget-s", type=float, default=280.0,
                        help="start no new case after this many seconds (a case takes up to ~90 s)")
    parser.add_argument("--no-overhead", action="store_true", help="skip the tiny-graph overhead section")
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/gpu_ab_<device>_<date>.json)")
    parser.add_argument("--in-process", action="store_true", help="run the cases in this process (by default each "
                        "runs in its own, so a CUDA error or a hang costs one case)")
    parser.add_argument("--case-timeout-s", type=float, default=240.0, help="time limit of one case's process")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: MODEL:DTYPE:BATCH, run by run_isolated
    parser.add_argument("--case-out", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_ab needs a CUDA device", file=sys.stderr)
        return 2
    if args.case:  # one case, in a process of its own (run_isolated)
        model_name, dtype_name, batch = args.case.split(":")
        outcome = one_case(model_name, dtype_name, int(batch), [r for r in args.runners.split(",") if r],
                           set(args.peer_models.split(",")), {int(b) for b in args.peer_batches.split(",") if b}, args)
        Path(args.case_out).write_text(json.dumps(outcome, default=str))
        return 0
    started = time.perf_counter()
    device_name = torch.cuda.get_device_name()
    short = device_name.lower().replace("nvidia", "").strip().split()[0] if device_name else "gpu"
    out = Path(args.out or f"benchmarks/results/gpu_ab_{short}_{datetime.date.today().isoformat()}.json")
    model_names = [m for m in args.models.split(",") if m]
    dtypes = [d for d in args.dtypes.split(",") if d]
    batches = [int(b) for b in args.batches.split(",") if b]
    peer_batches = {int(b) for b in args.peer_batches.split(",") if b}
    peer_models = {m for m in args.peer_models.split(",") if m}
    runner_names = [r for r in args.runners.split(",") if r]
    for value, valid, what in ((model_names, VALID_MODELS, "model"), (dtypes, DTYPES, "dtype"),
                               (runner_names, RUNNERS, "runner")):
        bad = [v for v in value if v not in valid]
        if bad:
            parser.error(f"unknown {what} {bad}; valid: {', '.join(valid)}")
    if "eager" not in runner_names:
        runner_names.insert(0, "eager")
    result = dict(device=device_name, torch=torch.__version__, cuda=torch.version.cuda,
                  cudnn=torch.backends.cudnn.version(), python=platform.python_version(),
                  date=datetime.datetime.now().isoformat(timespec="seconds"),
                  config=vars(args), passes=list(fxdream.available_passes()), cases=[], skipped_cases=[])
    log(f"{device_name}, torch {torch.__version__}, passes {', '.join(result['passes'])}")

    def save():
        out.parent.mkdir(parents=True, exist_ok=True)
        result["elapsed_s"] = time.perf_counter() - started
        out.write_text(json.dumps(result, indent=1, default=str))

    if not args.no_overhead:
        log("per-call overhead on a tiny graph")
        try:
            result["runner_overhead"] = runner_overhead(log)
        except Exception as error:
            result["runner_overhead"] = dict(error=f"{type(error).__name__}: {error}",
                                             traceback=traceback.format_exc(limit=8))
            log(f"  failed: {error}")
        _cleanup()
        save()
    def case_done(model_name, dtype_name, batch, outcome):
        kind, row = outcome
        if kind == "case":
            result["cases"].append(row)
        else:
            result["skipped_cases"].append(dict(model=model_name, dtype=dtype_name, batch=int(batch), **row))
        save()

    cases = plan_cases(model_names, dtypes, batches)
    if args.in_process:
        for model_name, dtype_name, batch in cases:
            elapsed = time.perf_counter() - started
            if elapsed > args.budget_s:
                case_done(model_name, dtype_name, batch, ("skipped", dict(
                    reason=f"time budget spent ({elapsed:.0f} s > {args.budget_s:.0f} s)")))
                continue
            log(f"{model_name} {dtype_name} bs{batch} ({elapsed:.0f} s elapsed)")
            case_done(model_name, dtype_name, batch, one_case(model_name, dtype_name, batch, runner_names,
                                                               peer_models, peer_batches, args))
    else:  # each case in its own process: a CUDA error ends one case, not the run
        passed = ["--runners", ",".join(runner_names), "--peer-models", args.peer_models,
                  "--peer-batches", args.peer_batches, "--rounds", str(args.rounds), "--block", str(args.block)]
        names = [f"{m}:{d}:{b}" for m, d, b in cases]
        for name, outcome, why in run_isolated(names, __file__, passed, args.case_timeout_s,
                                               args.budget_s - (time.perf_counter() - started), log):
            log(f"{name}: {'done' if outcome else why}")
            case_done(*name.split(":"), tuple(outcome) if outcome else ("skipped", dict(reason=why)))
    save()
    log(f"wrote {out} in {time.perf_counter() - started:.0f} s")
    print(to_markdown(result))
    return 0


def to_markdown(result: dict) -> str:
    lines = [f"GPU A/B on {result['device']} (torch {result['torch']})", "",
             "| model | dtype | bs | runner | ms | vs eager | build s | predicted ms | pred. err % |",
             "|---|---|---|---|---|---|---|---|---|"]
    for case in result["cases"]:
        for name, row in case["runners"].items():
            if "median_ms" not in row:
                continue
            predicted = row.get("predicted_optimized_ms") or row.get("predicted_baseline_ms")
            err = row.get("predicted_error_pct")
            lines.append(f"| {case['model']} | {case['dtype']} | {case['batch']} | {name} | {row['median_ms']:.3f} | "
                         f"{(row.get('speedup_vs_eager') or 0):.2f}x | {row['build_s']:.1f} | "
                         f"{'' if predicted is None else f'{predicted:.3f}'} | {'' if err is None else f'{err:+.1f}'} |")
    overhead = result.get("runner_overhead", {}).get("us_per_call")
    if overhead:
        lines += ["", "tiny graph, µs per call: " + ", ".join(f"{k} {v:.1f}" for k, v in overhead.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
