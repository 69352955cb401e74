"""Where the time goes, op kind by op kind: fxdream against ONNX Runtime and OpenVINO (f32) on one model.

Each engine runs the model ``--calls`` times under its own profiler: fxdream's built graphs timed
op by op in context (its in-context profiler, as a build does), ONNX Runtime with session profiling (time per
graph node), OpenVINO with ``PERF_COUNT`` (time per executed layer). The engines take turns for
``--rounds`` rounds (the order rotating), and each op kind's time is the median over the rounds,
so that the machine's speed, which drifts over minutes, moves every engine alike.

Ops are grouped into kinds (convolutions 1x1 and larger, pooling, matmul / linear,
normalization, elementwise, reorder / copy, other). fxdream's convolutions are oneDNN kernels
called through torch's wrapper (``mkldnn._convolution_pointwise``); the column "fxdream, inside
oneDNN" is the same calls timed by oneDNN itself (its verbose log's execution times), so the
difference is torch's cost per call around the kernel. A convolution is 1x1 by its weight's
shape for fxdream and ONNX Runtime, by its kernel's name (``brgconv_1x1``) for oneDNN and OpenVINO.
Profilers cost time of their own: compare kinds across engines, and walls with cpu_ab.py.

    python benchmarks/cpu_peer_profile.py --model resnet50 --batch 1
    python benchmarks/cpu_peer_profile.py --model resnet50 --batch 1 --precision bf16   # against OpenVINO bf16
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from cpu_peers import require

import fxdream
from fxdream.build import cost_model_for
from fxdream.capturing.dynamo import describe_error
from fxdream.cli_arguments import build_model, file_safe
from fxdream.ir.nodes import op_name

RESULTS = Path(__file__).parent / "results"
KINDS = (("reorder / copy", ("reorder", "copy", "transpose", "clone", "contiguous", "convert", "_to_copy")),
         ("convolution", ("conv",)),
         ("pooling", ("pool",)),
         ("matmul / linear", ("matmul", "gemm", "linear", "addmm", "mm", "fullyconnected", "fc", "bmm",
                                     "inner_product")),
         ("normalization", ("norm", "mvn")),
         ("elementwise", ("relu", "add", "mul", "eltwise", "gelu", "sigmoid", "tanh", "div", "sub", "softmax",
                                 "binary")))
ONE_BY_ONE, LARGER = " 1x1", " kxk"  # suffixes of a convolution's label


def kind_of(op: str) -> str:
    name = op.lower()
    for kind, needles in KINDS:
        if any(n in name for n in needles):
            if kind == "convolution" and name.endswith((ONE_BY_ONE, LARGER)):
                return f"{kind}{name[-4:]}"
            return kind
    return "other"


def _by_kind(times_us: dict[str, float]) -> dict[str, float]:
    """µs per call per op label → ms per call per kind."""
    kinds: dict[str, float] = collections.defaultdict(float)
    for op, us in times_us.items():
        kinds[kind_of(op)] += us / 1e3
    return dict(kinds)


def _timed(run, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        run()
    return (time.perf_counter() - started) / calls * 1e3


def _geometry(weight_shape) -> str:
    return ONE_BY_ONE if weight_shape is not None and all(s == 1 for s in weight_shape[2:]) else LARGER


class FxdreamProfile:
    """fxdream's own in-context timing of each op of the built graphs (its convolutions call
    oneDNN through torch's wrapper, which torch.profiler does not see)."""

    def __init__(self, model, inputs, precision: str = "fp32"):
        self.module = fxdream.optimize(model, inputs, passes="auto", precision=precision)
        self.inputs = inputs
        self.extra = {"passes": [p.name for p in self.module.report.passes if p.applied]}
        self.kernels_us: list[dict[str, float]] = []  # per round: oneDNN's own timing per label

    def round(self, calls: int) -> tuple[dict[str, float], float]:
        module, inputs = self.module, self.inputs
        cost = cost_model_for("cpu", "profiled")
        with torch.no_grad():
            for _ in range(3):
                module(*inputs)
            wall = _timed(lambda: module(*inputs), calls)
            cost.profile_in_context(module.captured, rounds=calls, warmup=1, graphs=module.rewritten_graphs)
            self.kernels_us.append(onednn_kernels_us(lambda: module(*inputs), calls))
        times: dict[str, float] = collections.defaultdict(float)
        parts = module.captured if isinstance(module.captured, tuple) else (module.captured,)
        for part in parts:
            gm = module.rewritten_graphs.get((part.index, "fw"), part.forward)
            for node in gm.graph.nodes:
                if node.op == "call_function":
                    times[_fxdream_label(node)] += cost.kernel_us(node)
        return dict(times), wall


def _fxdream_label(node) -> str:
    name = op_name(node)
    if "conv" not in name:
        return name
    weight = node.args[2] if "binary" in str(node.target) else node.args[1]  # (x, other, weight, ...)
    value = weight.meta.get("val") if hasattr(weight, "meta") else None
    return name + _geometry(tuple(value.shape) if isinstance(value, torch.Tensor) else None)


def onednn_kernels_us(run, calls: int) -> dict[str, float]:
    """µs per call inside oneDNN's primitives while ``run`` runs ``calls`` times, by primitive
    kind (convolutions by kernel: 1x1 or larger), from oneDNN's verbose log, which it writes to
    the process's standard output (captured here from file descriptor 1)."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    with tempfile.TemporaryFile(mode="w+") as log:
        os.dup2(log.fileno(), 1)
        try:
            with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
                for _ in range(calls):
                    run()
            libc.fflush(None)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        log.seek(0)
        lines = [line.split(",") for line in log.read().splitlines()
                 if line.startswith("onednn_verbose") and ",exec," in line]
    times: dict[str, float] = collections.defaultdict(float)
    for fields in lines:  # onednn_verbose,v1,primitive,exec,cpu,KIND,IMPL,...,ms
        if fields[2] != "primitive":  # oneDNN Graph's partition totals: the primitives they ran are logged too
            continue
        kind, impl, ms = fields[5], fields[6], float(fields[-1])
        label = f"{kind}{ONE_BY_ONE if '1x1' in impl else LARGER}" if kind == "convolution" else kind
        times[label] += ms * 1e3 / calls
    return dict(times)


class OnnxRuntimeProfile:
    """ONNX Runtime's session profile: each round a new session (a profile ends with its file)."""

    def __init__(self, model, inputs):
        self.ort = require("onnxruntime")
        self.folder = tempfile.mkdtemp(prefix="fxdream_ort_profile_")
        self.path = os.path.join(self.folder, "model.onnx")
        with torch.no_grad():
            torch.onnx.export(model, tuple(inputs), dynamo=True, verbose=False).save(self.path)
        self.inputs, self.extra = inputs, {}

    def round(self, calls: int) -> tuple[dict[str, float], float]:
        options = self.ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")  # as cpu_peers runs it
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(self.folder, "ort")
        session = self.ort.InferenceSession(self.path, options, providers=["CPUExecutionProvider"])
        feed = {i.name: t.numpy() for i, t in zip(session.get_inputs(), self.inputs)}
        warmup = 3
        for _ in range(warmup):
            session.run(None, feed)
        wall = _timed(lambda: session.run(None, feed), calls)
        events = json.loads(Path(session.end_profiling()).read_text())
        times: dict[str, float] = collections.defaultdict(float)
        for e in events:
            if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
                times[_ort_label(e["args"])] += e["dur"] / (calls + warmup)  # the warm-ups are in the profile
        return dict(times), wall


def _ort_label(args: dict) -> str:
    name = args["op_name"]
    if "conv" not in name.lower():
        return name
    shapes = [next(iter(s.values())) for s in args.get("input_type_shape", [])]
    return name + _geometry(shapes[1] if len(shapes) > 1 else None)


class OpenVinoProfile:
    """OpenVINO's ``PERF_COUNT``: time per executed layer, read after every call."""

    def __init__(self, model, inputs, f32: bool = True):
        ov = require("openvino")
        with torch.no_grad():
            converted = ov.convert_model(model, example_input=tuple(inputs))
        config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": torch.get_num_threads(),
                  "PERF_COUNT": True, **({"INFERENCE_PRECISION_HINT": "f32"} if f32 else {})}
        self.request = ov.Core().compile_model(converted, "CPU", config).create_infer_request()
        self.arrays = [t.numpy() for t in inputs]
        self.extra = {"exec_types": {}}

    def round(self, calls: int) -> tuple[dict[str, float], float]:
        for _ in range(3):
            self.request.infer(self.arrays)
        times: dict[str, float] = collections.defaultdict(float)
        started = time.perf_counter()
        for _ in range(calls):
            self.request.infer(self.arrays)
            for info in self.request.get_profiling_info():
                label = info.node_type
                if label == "Convolution":
                    label += ONE_BY_ONE if "1x1" in info.exec_type else LARGER
                times[label] += info.real_time.total_seconds() * 1e6 / calls
                self.extra["exec_types"].setdefault(label, info.exec_type)
        wall = (time.perf_counter() - started) / calls * 1e3  # includes reading the counters
        return dict(times), wall


def conv_call_costs(model, inputs, calls: int = 100) -> list[dict]:
    """For each distinct 2-d convolution of ``model`` (its shapes read by hooks on one eager
    call): the prepacked oneDNN convolution fxdream calls, timed in a loop through torch and
    inside oneDNN (its verbose log), in µs per call, with how many of it the model has. The
    difference is what torch's call costs around the kernel."""
    seen: collections.Counter = collections.Counter()

    def record(conv, args, _output):
        seen[(tuple(args[0].shape), tuple(conv.weight.shape), conv.stride, conv.padding, conv.dilation,
              conv.groups, conv.bias is not None)] += 1
    hooks = [m.register_forward_hook(record) for m in model.modules()
             if isinstance(m, torch.nn.Conv2d) and isinstance(m.padding, tuple)]
    with torch.no_grad():
        model(*inputs)
    for hook in hooks:
        hook.remove()
    rows = []
    conv = torch.ops.mkldnn._convolution_pointwise.default
    for (x_shape, w_shape, stride, padding, dilation, groups, has_bias), count in seen.items():
        x = torch.randn(x_shape).contiguous(memory_format=torch.channels_last)
        packed = torch.ops.mkldnn._reorder_convolution_weight(
            torch.randn(w_shape), list(padding), list(stride), list(dilation), groups, list(x_shape))
        bias = torch.randn(w_shape[0]) if has_bias else None
        run = lambda: conv(x, packed, bias, list(padding), list(stride), list(dilation), groups,  # noqa: E731
                           "relu", [], "")
        with torch.no_grad():
            for _ in range(10):
                run()
            through = min(_timed(run, calls) for _ in range(3)) * 1e3
            inside = min(sum(onednn_kernels_us(run, calls).values()) for _ in range(3))
        rows.append({"input": x_shape, "weight": w_shape, "stride": stride, "count": count,
                     "through_torch_us": through, "inside_onednn_us": inside})
    return rows


def conv_costs_markdown(rows: list[dict]) -> str:
    lines = ["| input | weight | stride | count | µs through torch | µs inside oneDNN | µs around the kernel |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['input']} | {r['weight']} | {r['stride']} | {r['count']} | {r['through_torch_us']:.1f} | "
                     f"{r['inside_onednn_us']:.1f} | {r['through_torch_us'] - r['inside_onednn_us']:.1f} |")
    around = sum((r["through_torch_us"] - r["inside_onednn_us"]) * r["count"] for r in rows) / 1e3
    convs = sum(r["count"] for r in rows)
    return "\n".join(lines) + (f"\n\nAround the kernels, over the model's {convs} convolutions: "
                              f"{around:.2f} ms per call.\n")


def _median_times(rounds: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for r in rounds for k in r}
    return {k: statistics.median(r.get(k, 0.0) for r in rounds) for k in keys}


def profile_interleaved(engines: dict, calls: int, rounds: int) -> dict[str, dict]:
    """Each engine's median op times and wall over ``rounds`` rounds, the engines taking turns."""
    samples = {name: [] for name in engines}
    order = list(engines)
    for r in range(rounds):
        for name in order[r % len(order):] + order[:r % len(order)]:
            print(f"round {r + 1}/{rounds}: {name} ...", flush=True)
            samples[name].append(engines[name].round(calls))
    rows = {}
    for name, engine in engines.items():
        times = _median_times([t for t, _ in samples[name]])
        kinds = _by_kind(times)
        rows[name] = {"wall_ms": statistics.median(w for _, w in samples[name]), "ops_ms": sum(kinds.values()),
                      "by_kind_ms": kinds, **engine.extra,
                      "top_ops_ms": dict(sorted(((k, v / 1e3) for k, v in times.items()), key=lambda kv: -kv[1])[:12])}
        if isinstance(engine, FxdreamProfile):
            inside = _by_kind(_median_times(engine.kernels_us))
            rows[f"{name}, inside oneDNN"] = {"ops_ms": sum(inside.values()), "by_kind_ms": inside}
    return rows


def to_markdown(rows: dict[str, dict], not_run: dict[str, str]) -> str:
    kinds = sorted({k for r in rows.values() for k in r["by_kind_ms"]})
    lines = [f"| kind (ms per call, profiled) | {' | '.join(rows)} |", "|---|" + "---|" * len(rows)]
    for kind in kinds:
        lines.append(f"| {kind} | " + " | ".join(f"{r['by_kind_ms'].get(kind, 0.0):.2f}" for r in rows.values()) + " |")
    lines.append("| all ops | " + " | ".join(f"{r['ops_ms']:.2f}" for r in rows.values()) + " |")
    lines.append("| wall per call | " + " | ".join(f"{r['wall_ms']:.2f}" if "wall_ms" in r else "–"
                                                  for r in rows.values()) + " |")
    lines += [f"\n{name}: not run: {why}" for name, why in not_run.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="fp32", choices=("fp32", "bf16"),
                        help="bf16: fxdream's precision='bf16' against OpenVINO at its default precision")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    model, inputs, _ = build_model(args.model, args.batch)
    model = model.eval()
    builders = (("fxdream", FxdreamProfile), ("onnxruntime", OnnxRuntimeProfile),
                ("openvino_f32", OpenVinoProfile)) if args.precision == "fp32" else (
        ("fxdream_bf16", lambda *a: FxdreamProfile(*a, precision="bf16")),
        ("openvino", lambda *a: OpenVinoProfile(*a, f32=False)))
    engines, not_run = {}, {}
    for name, build in builders:
        print(f"building {name} ...", flush=True)
        try:
            engines[name] = build(model, inputs)
            engines[name].round(1)  # an engine that cannot run the model fails here, not mid-rounds
        except Exception as error:  # an engine that cannot convert or run the model: its row says why
            engines.pop(name, None)
            not_run[name] = describe_error(error)
            print(f"{name}: not run: {not_run[name]}", flush=True)
    for engine in engines.values():
        if isinstance(engine, FxdreamProfile):
            engine.kernels_us.clear()  # the trial round's
    rows = profile_interleaved(engines, args.calls, args.rounds)
    print("timing the model's convolutions one by one ...", flush=True)
    convs = conv_call_costs(model, inputs) if "fxdream" in engines else []
    table = to_markdown(rows, not_run) + (f"\nfxdream's convolutions, each alone in a loop:\n\n"
                                          f"{conv_costs_markdown(convs)}" if convs else "")
    print(table)
    suffix = "" if args.precision == "fp32" else f"_{args.precision}"
    name = f"cpu_peer_profile_{file_safe(args.model)}_bs{args.batch}{suffix}_{datetime.date.today()}.json"
    out = Path(args.out or RESULTS / name)
    out.write_text(json.dumps({"model": args.model, "batch": args.batch, "calls": args.calls, "rounds": args.rounds,
                               "threads": torch.get_num_threads(), "torch": torch.__version__,
                               "precision": args.precision, "engines": rows, "not_run": not_run,
                               "convolutions_alone": convs}, indent=1) + "\n")
    out.with_suffix(".md").write_text(table)
    print(f"wrote {out} and {out.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
