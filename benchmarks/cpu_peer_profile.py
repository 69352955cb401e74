"""Where the time goes, op kind by op kind: fxdream against ONNX Runtime and OpenVINO (f32) on one model.

Each engine runs the model ``--calls`` times under its own profiler: fxdream's built graphs timed
op by op in context (its in-context profiler, as a build does), ONNX Runtime with session profiling (time per
graph node), OpenVINO with ``PERF_COUNT`` (time per executed layer). Ops are grouped into kinds
(convolution, pooling, matmul / linear, normalization, elementwise, reorder / copy, other) and each
engine's per-call ms per kind is put side by side, with the wall time per call and what the
profiler does not attribute to an op (per-op dispatch, Python, the runtime itself). Profilers
cost time of their own: compare kinds across engines, and walls with cpu_ab.py, not with these.

    python benchmarks/cpu_peer_profile.py --model resnet50 --batch 1
    python benchmarks/cpu_peer_profile.py --model resnet50 --batch 1 --precision bf16   # against OpenVINO bf16
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
from cpu_peers import require

import fxdream
from fxdream.build import cost_model_for
from fxdream.capturing.dynamo import describe_error
from fxdream.cli import build_model, file_safe
from fxdream.ir.nodes import op_name

RESULTS = Path(__file__).parent / "results"
KINDS = (("reorder / copy", ("reorder", "copy", "transpose", "clone", "contiguous", "convert", "_to_copy")),
         ("convolution", ("conv",)),
         ("pooling", ("pool",)),
         ("matmul / linear", ("matmul", "gemm", "linear", "addmm", "mm", "fullyconnected", "fc", "bmm")),
         ("normalization", ("norm", "mvn")),
         ("elementwise", ("relu", "add", "mul", "eltwise", "gelu", "sigmoid", "tanh", "div", "sub", "softmax")))


def kind_of(op: str) -> str:
    name = op.lower()
    for kind, needles in KINDS:
        if any(n in name for n in needles):
            return kind
    return "other"


def _by_kind(times_us: dict[str, float], calls: int) -> dict[str, float]:
    kinds: dict[str, float] = collections.defaultdict(float)
    for op, us in times_us.items():
        kinds[kind_of(op)] += us / calls / 1e3
    return dict(kinds)


def _timed(run, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - started) / calls * 1e3


def profile_fxdream(model, inputs, calls: int, precision: str = "fp32") -> tuple[dict, float, dict]:
    """fxdream's own in-context timing of each op of the built graphs (its convolutions call
    oneDNN directly, which torch.profiler does not see), ``calls`` rounds."""
    module = fxdream.optimize(model, inputs, passes="auto", precision=precision)
    cost = cost_model_for("cpu", "profiled")
    with torch.no_grad():
        for _ in range(3):
            module(*inputs)
        wall = _timed(lambda: module(*inputs), calls)
        cost.profile_in_context(module.captured, rounds=calls, warmup=1, graphs=module.rewritten_graphs)
    times: dict[str, float] = collections.defaultdict(float)
    parts = module.captured if isinstance(module.captured, tuple) else (module.captured,)
    for part in parts:
        gm = module.rewritten_graphs.get((part.index, "fw"), part.forward)
        for node in gm.graph.nodes:
            if node.op == "call_function":
                times[op_name(node)] += cost.kernel_us(node) * calls
    return dict(times), wall, {"passes": [p.name for p in module.report.passes if p.applied]}


def profile_onnxruntime(model, inputs, calls: int) -> tuple[dict, float, dict]:
    ort = require("onnxruntime")
    folder = tempfile.mkdtemp(prefix="fxdream_ort_profile_")
    path = os.path.join(folder, "model.onnx")
    with torch.no_grad():
        torch.onnx.export(model, tuple(inputs), dynamo=True, verbose=False).save(path)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(folder, "ort")
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    feed = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}
    for _ in range(3):
        session.run(None, feed)
    wall = _timed(lambda: session.run(None, feed), calls)
    events = json.loads(Path(session.end_profiling()).read_text())
    times: dict[str, float] = collections.defaultdict(float)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            times[e["args"]["op_name"]] += e["dur"]
    runs = calls + 3  # the warm-up runs are in the profile too
    return {k: v * calls / runs for k, v in times.items()}, wall, {}


def profile_openvino(model, inputs, calls: int, f32: bool = True) -> tuple[dict, float, dict]:
    ov = require("openvino")
    with torch.no_grad():
        converted = ov.convert_model(model, example_input=tuple(inputs))
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": torch.get_num_threads(), "PERF_COUNT": True,
              **({"INFERENCE_PRECISION_HINT": "f32"} if f32 else {})}
    request = ov.Core().compile_model(converted, "CPU", config).create_infer_request()
    arrays = [t.numpy() for t in inputs]
    for _ in range(3):
        request.infer(arrays)
    times: dict[str, float] = collections.defaultdict(float)
    exec_types: dict[str, str] = {}
    started = time.perf_counter()
    for _ in range(calls):
        request.infer(arrays)
        for info in request.get_profiling_info():
            us = info.real_time.total_seconds() * 1e6
            times[info.node_type] += us
            exec_types.setdefault(info.node_type, info.exec_type)
    wall = (time.perf_counter() - started) / calls * 1e3  # includes reading the counters
    return dict(times), wall, {"exec_types": exec_types}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                        help="bf16: fxdream's precision='bf16' against OpenVINO at its default precision")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    model, inputs, _ = build_model(args.model, args.batch)
    model = model.eval()
    rows = {}
    engines = (("fxdream", profile_fxdream), ("onnxruntime", profile_onnxruntime),
               ("openvino_f32", profile_openvino)) if args.precision == "fp32" else (
        ("fxdream_bf16", lambda *a: profile_fxdream(*a, precision="bf16")),
        ("openvino", lambda *a: profile_openvino(*a, f32=False)))
    not_run = {}
    for name, profile in engines:
        print(f"profiling {name} ...", flush=True)
        try:
            times, wall, extra = profile(model, inputs, args.calls)
        except Exception as error:  # an engine that cannot convert or run the model: its row says why
            not_run[name] = describe_error(error)
            print(f"{name}: not run: {not_run[name]}", flush=True)
            continue
        kinds = _by_kind(times, args.calls)
        rows[name] = {"wall_ms": wall, "ops_ms": sum(kinds.values()), "by_kind_ms": kinds, **extra,
                      "top_ops_ms": dict(sorted(((k, v / args.calls / 1e3) for k, v in times.items()),
                                                key=lambda kv: -kv[1])[:12])}
    kinds = sorted({k for r in rows.values() for k in r["by_kind_ms"]})
    lines = [f"| kind (ms per call, profiled) | {' | '.join(rows)} |", "|---|" + "---|" * len(rows)]
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(f"{r['by_kind_ms'].get(kind, 0.0):.2f}" for r in rows.values()) + " |")
    lines.append("| all ops | " + " | ".join(f"{r['ops_ms']:.2f}" for r in rows.values()) + " |")
    lines.append("| wall per call | " + " | ".join(f"{r['wall_ms']:.2f}" for r in rows.values()) + " |")
    lines += [f"\n{name}: not run: {why}" for name, why in not_run.items()]
    table = "\n".join(lines) + "\n"
    print(table)
    suffix = "" if args.precision == "fp32" else f"_{args.precision}"
    name = f"cpu_peer_profile_{file_safe(args.model)}_bs{args.batch}{suffix}_{datetime.date.today()}.json"
    out = Path(args.out or RESULTS / name)
    out.write_text(json.dumps({"model": args.model, "batch": args.batch, "calls": args.calls,
                               "threads": torch.get_num_threads(), "torch": torch.__version__,
                               "precision": args.precision, "engines": rows, "not_run": not_run}, indent=1) + "\n")
    out.with_suffix(".md").write_text(table)
    print(f"wrote {out} and {out.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
