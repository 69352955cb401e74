"""GPU A/B of aux_stream_backward: ResNet-50 training, baseline vs dgrad/wgrad on two streams.

For each dtype (fp32; fp16 = torch.autocast) and batch size: the model captured by fxdream
with no pass (baseline) and with ``aux_stream_backward`` forced, timed interleaved with
``fxdream.measure.time_interleaved`` (median ms per step over rounds of blocks). A step is
forward + ``loss.backward()`` with the gradients reset to None first; no optimizer step
(the predictions leave it out too). Beside each measurement: the predicted step time
(``fxdream.sim.prediction.predict`` with the cost model the pass judges with: analytic roofline +
the fill model of ``fxdream.sim.occupancy``, and the plain analytic model for reference),
the pass's automatic decision (``AuxStreamBackward(force=False)``: the "auto" time is the
baseline's when it declines), peak memory (``torch.cuda.max_memory_allocated`` over a few
steps, each variant alone) and the predicted peak change, and the largest gradient
difference. The host cost of the stream helpers is measured too (``host_overheads_us``), to
replace the estimates ``EVENT_HOST_US`` / ``STREAM_SWITCH_HOST_US``.

    python benchmarks/gpu_aux_stream.py                      # bs 32,128,256 x fp32,fp16 (~5 min on an H100)
    python benchmarks/gpu_aux_stream.py --batches 32 --dtypes fp16 --rounds 3 --trace /tmp/aux

Writes JSON to --out (default benchmarks/results/gpu_aux_stream_<device>_<date>.json).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time

import torch

import fxdream
from fxdream import models
from fxdream.ir.graphs import copy_graph_module
from fxdream.measure import time_interleaved
from fxdream.pass_api import PassContext
from fxdream.passes.aux_stream_backward import AuxStreamBackward
from fxdream.runtime import streams
from fxdream.sim.cost.analytic import Analytic
from fxdream.sim.cost.devices import get_device
from fxdream.sim.cost.occupancy import EVENT_HOST_US, STREAM_SWITCH_HOST_US, OccupancyAware
from fxdream.sim.prediction import predict, this_machine_device

PASS = "aux_stream_backward"
DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class Autocast(torch.nn.Module):
    """The model under torch.autocast (dynamo captures the autocast region)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype):
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, *inputs):
        with torch.autocast(inputs[0].device.type, dtype=self.dtype):
            return self.model(*inputs)


def log(*parts) -> None:
    print(*parts, flush=True)


def step_fn(module, inputs, loss_fn):
    params = list(module.parameters())

    def step():
        for p in params:
            p.grad = None
        loss_fn(module(*inputs)).backward()
    return step


def _pct(value) -> str:
    return "n/a (no CUDA)" if value is None else f"{value:+.2f} %"


def peak_memory(step, steps: int = 3) -> int:
    if not torch.cuda.is_available():
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()


def grads_after_step(module, inputs, loss_fn) -> list:
    step_fn(module, inputs, loss_fn)()
    return [None if p.grad is None else p.grad.detach().clone() for p in module.parameters()]


def host_overheads_us(calls: int = 2000) -> dict:
    """Host µs per call of the stream helpers (the simulator's EVENT_HOST_US / STREAM_SWITCH_HOST_US)."""
    a, b = torch.ones(16, device="cuda"), torch.ones(16, device="cuda")
    add = torch.ops.aten.add.Tensor
    on_aux = streams.OnStream(add, 1)
    device = f"cuda:{torch.cuda.current_device()}"

    def per_call(fn) -> float:
        fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(5):
            started = time.perf_counter()
            for _ in range(calls):
                fn()
            samples.append((time.perf_counter() - started) * 1e6 / calls)
            torch.cuda.synchronize()
        return statistics.median(samples)

    def record_wait():
        streams.wait_event(streams.record_event(device, 0), device, 1)
    plain, switched = per_call(lambda: add(a, b)), per_call(lambda: on_aux(a, b))
    torch.cuda.current_stream().wait_stream(streams.get_stream(device, 1))
    return {"record_event+wait_event": per_call(record_wait), "aten.add": plain, "OnStream(aten.add)": switched,
            "stream_switch_extra": switched - plain,
            "simulator_estimates": {"EVENT_HOST_US (each)": EVENT_HOST_US, "STREAM_SWITCH_HOST_US": STREAM_SWITCH_HOST_US}}


def auto_decision(optimized, spec_name: str) -> tuple[bool, str]:
    """What passes="auto" would do on each backward graph (by the analytic + fill-model prediction)."""
    applied, reasons = [], []
    for part in optimized.captured:
        if part.backward is None:
            continue
        ctx = PassContext(device="cuda", training=True, phase="bw", cost_model=Analytic(get_device(spec_name)),
                          forced=False)
        result = AuxStreamBackward(force=False)(copy_graph_module(part.backward), ctx)
        applied.append(result.modified)
        reasons.append(f"{part.index}/bw: {result.reason}")
    return any(applied), " | ".join(reasons)


def trace_step(step, path: str) -> None:
    from torch.profiler import ProfilerActivity, profile
    for _ in range(2):
        step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    prof.export_chrome_trace(path)


def run_case(model_name: str, batch: int, dtype_name: str, args, spec_name: str) -> dict:
    torch._dynamo.reset()
    if args.device == "cuda":
        torch.cuda.empty_cache()
    model, inputs, loss_fn = models.build(model_name, batch, device=args.device, tiny=args.tiny)
    net = model if DTYPES[dtype_name] is None else Autocast(model, DTYPES[dtype_name])
    net.train()
    started = time.perf_counter()
    baseline = fxdream.optimize(net, inputs, training=True, device=args.device, cost=None)
    with_pass = fxdream.optimize(net, inputs, passes=[PASS], training=True, device=args.device, cost=args.cost)
    build_s = time.perf_counter() - started
    rows = [r for r in with_pass.report.passes if r.phase == "bw"]
    log(f"  built in {build_s:.1f} s; pass: " + " | ".join(r.reason for r in rows))

    spec = get_device(spec_name)
    occupancy_cost, plain_cost = OccupancyAware(Analytic(spec)), Analytic(spec)
    pred = {}
    for label, cost in (("", occupancy_cost), ("plain_", plain_cost)):
        before = predict(baseline.captured, cost, True)
        after = predict(baseline.captured, cost, True, graphs=with_pass.rewritten_graphs)
        pred[label] = (before, after)
    auto_applies, auto_reason = auto_decision(with_pass, spec_name)

    steps = {"baseline": step_fn(baseline, inputs, loss_fn), "aux_stream": step_fn(with_pass, inputs, loss_fn)}
    grads_base = grads_after_step(baseline, inputs, loss_fn)
    grads_aux = grads_after_step(with_pass, inputs, loss_fn)
    max_diff = max((float((a - b).abs().max()) for a, b in zip(grads_base, grads_aux) if a is not None), default=0.0)
    times = time_interleaved(steps, rounds=args.rounds, block=args.block, warmup=args.warmup,
                             desc=f"{model_name} bs{batch} {dtype_name}")
    peaks = {name: peak_memory(step) for name, step in steps.items()}
    if args.trace:
        os.makedirs(args.trace, exist_ok=True)
        for name, step in steps.items():
            trace_step(step, os.path.join(args.trace, f"{model_name}_bs{batch}_{dtype_name}_{name}.json"))

    base_ms, aux_ms = times["baseline"].median_ms, times["aux_stream"].median_ms
    (p_before, p_after), (q_before, q_after) = pred[""], pred["plain_"]
    row = dict(
        model=model_name, batch=batch, dtype=dtype_name,
        measured_baseline_ms=base_ms, measured_aux_ms=aux_ms,
        measured_spread_pct={k: v.spread_pct for k, v in times.items()},
        measured_delta_pct=100.0 * (aux_ms / base_ms - 1.0),
        predicted_baseline_ms=p_before.time_ms, predicted_aux_ms=p_after.time_ms,
        predicted_delta_pct=100.0 * (p_after.time_ms / p_before.time_ms - 1.0),
        predicted_plain_analytic_delta_pct=100.0 * (q_after.time_ms / q_before.time_ms - 1.0),
        auto_applies=auto_applies, auto_reason=auto_reason,
        auto_ms=aux_ms if auto_applies else base_ms,
        auto_vs_baseline_pct=100.0 * ((aux_ms if auto_applies else base_ms) / base_ms - 1.0),
        peak_baseline_bytes=peaks["baseline"], peak_aux_bytes=peaks["aux_stream"],
        peak_delta_pct=100.0 * (peaks["aux_stream"] / peaks["baseline"] - 1.0) if peaks["baseline"] else None,
        predicted_peak_baseline_bytes=p_before.peak_memory_bytes, predicted_peak_aux_bytes=p_after.peak_memory_bytes,
        predicted_peak_delta_pct=100.0 * (p_after.peak_memory_bytes / p_before.peak_memory_bytes - 1.0),
        max_grad_abs_diff=max_diff, build_s=build_s, pass_reasons=[r.reason for r in rows],
    )
    row["prediction_error_points"] = row["predicted_delta_pct"] - row["measured_delta_pct"]
    log(f"  measured {base_ms:.2f} → {aux_ms:.2f} ms ({row['measured_delta_pct']:+.2f} %), predicted "
        f"{row['predicted_delta_pct']:+.2f} % (plain analytic {row['predicted_plain_analytic_delta_pct']:+.2f} %); "
        f"auto {'applies' if auto_applies else 'declines'} ({row['auto_vs_baseline_pct']:+.2f} %); peak memory "
        f"{_pct(row['peak_delta_pct'])} (predicted {row['predicted_peak_delta_pct']:+.2f} %); max grad diff {max_diff:.1e}")
    del baseline, with_pass, steps
    return row


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="resnet50")
    parser.add_argument("--batches", default="32,128,256")
    parser.add_argument("--dtypes", default="fp32,fp16", help="comma-separated: fp32, fp16, bf16 (autocast)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--cost", default="analytic", choices=("analytic", "profiled", "auto"),
                        help="cost model the pass judges with in the optimized build (profiled is slower)")
    parser.add_argument("--trace", help="write a Chrome trace of one step per variant into this folder")
    parser.add_argument("--out", help="JSON path (default benchmarks/results/gpu_aux_stream_<device>_<date>.json)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu only as a smoke test of this script "
                        "(no streams there: predictions for --gpu)")
    parser.add_argument("--gpu", default="h100", help="DeviceSpec to predict for when --device cpu")
    parser.add_argument("--tiny", action="store_true", help="the zoo's tiny config (smoke test)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_aux_stream: needs a CUDA device (or --device cpu for a smoke test)", file=sys.stderr)
        return 2
    spec_name = this_machine_device("cuda") if args.device == "cuda" else args.gpu
    date = datetime.date.today().isoformat()
    out = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                   f"gpu_aux_stream_{spec_name}_{date}.json")
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu"
    log(f"gpu_aux_stream: {args.model} on {device_name} ({spec_name}), torch {torch.__version__}, "
        f"cudnn {torch.backends.cudnn.version()}, tf32 conv {torch.backends.cudnn.allow_tf32}")
    started = time.perf_counter()
    overheads = host_overheads_us() if args.device == "cuda" else {}
    log(f"host overheads (µs per call): { {k: v for k, v in overheads.items() if k != 'simulator_estimates'} }")
    results = []
    for dtype_name in [d for d in args.dtypes.split(",") if d]:
        for batch in [int(b) for b in args.batches.split(",") if b]:
            log(f"[{time.perf_counter() - started:6.0f} s] {args.model} batch {batch} {dtype_name} ...")
            try:
                results.append(run_case(args.model, batch, dtype_name, args, spec_name))
            except torch.cuda.OutOfMemoryError as error:  # noqa: PERF203
                log(f"  out of memory: {str(error).splitlines()[0]}")
                results.append(dict(model=args.model, batch=batch, dtype=dtype_name, error=f"OOM: {error}"[:300]))
            except Exception as error:  # noqa: BLE001  (a failed case is a row, and the next case still runs)
                log(f"  failed: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}")
                results.append(dict(model=args.model, batch=batch, dtype=dtype_name,
                                    error=f"{type(error).__name__}: {error}"[:300]))
            os.makedirs(os.path.dirname(out), exist_ok=True)
            with open(out, "w") as f:  # after every case: a cut-off run keeps what it measured
                json.dump(dict(device=device_name, spec=spec_name, torch=torch.__version__,
                               cudnn=torch.backends.cudnn.version(), date=date, host=platform.node(),
                               step="forward + loss.backward(), grads reset to None; no optimizer step",
                               timing=dict(rounds=args.rounds, block=args.block, warmup=args.warmup),
                               cost=args.cost, host_overheads_us=overheads, rows=results,
                               targets="≥ +3 % at bs32 with ≤ +3 % memory; predicted Δ within 2 points of measured; "
                                       "auto never slower than baseline beyond noise"), f, indent=1)
    log(f"done in {time.perf_counter() - started:.0f} s: {out}")
    for r in results:
        if "error" in r:
            continue
        log(f"| {r['dtype']} bs{r['batch']} | measured {-r['measured_delta_pct']:+.2f} % faster | predicted "
            f"{-r['predicted_delta_pct']:+.2f} % | auto {r['auto_vs_baseline_pct']:+.2f} % | memory "
            f"{_pct(r['peak_delta_pct'])} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
