"""The seeds' GPU experiments as predictions, beside the seeds' own measurements (V100).

Nothing runs on a GPU: each model is captured on the meta device and simulated for a V100
three ways: the datasheet spec; the datasheet with the parameters fitted on the H200
(``fxdream/sim/cost/fits/h200.json``: PyTorch's host costs, the kernel floor, each kernel
class's startup and share of the roofline) carried over; and, for the CUDA-graph experiment,
that spec with its host costs scaled so the prediction without graphs equals the seed's own
time without graphs (MXNet's executor costs less per op than PyTorch's generated code; the
seed's second number is then a prediction from its first).

1. CUDA graphs (MXNet PR 19142): ResNet-50 fp16 inference at batch 1 and 128, without and
   with the ``cuda_graphs`` pass. Seed: 2.815 → 2.323 ms per batch at 1 (17.5 % less time),
   47.32 → 47.15 ms at 128 (0.4 %).
2. Two streams in the convolution backward (MXNet PR 14006): ResNet-50 fp16 training at
   batch 32, 128, 256 with ``aux_stream_backward``. Seed: +2-3 % speed at 32, ~1 % at 128,
   negligible at 256; memory +1.4 % (32) to +2.6 % (256).
3. The convolution bias gradient (Flux.jl issue 558): the MNIST conv net of Flux's model zoo
   (fxdream's ``mnist_convnet``: the same three conv layers), fp32 training: the share of GPU
   time in the bias-gradient reductions. Seed (cuDNN's backward-bias): 10.2 % of GPU time in
   one profile at a small batch, "around 28 %" at batch 1000.

    python benchmarks/seed_experiments.py      # ~2 min; writes results/seed_experiments_v100_predicted_<date>.{json,md}
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import torch
from fit_gpu_model import AutocastLike

from fxdream import models
from fxdream.capturing.capture_model import capture
from fxdream.plan import plan
from fxdream.sim.cost.analytic import Analytic
from fxdream.sim.cost.devices import FITS_DIR, DeviceSpec, datasheet_device, with_fit, with_parameters
from fxdream.sim.cost.occupancy import OccupancyAware
from fxdream.sim.prediction import predict
from fxdream.sim.taskgraph import TaskKind

RESULTS = Path(__file__).parent / "results"
HOST_PARAMETERS = ("dispatch_overhead_us", "launch_overhead_us")
SEED_GRAPHS_MS = {1: (2.8153, 2.3230), 128: (47.3195, 47.1528)}   # ms per batch, 1000 batches timed
SEED_AUX = {32: "+2-3 % speed, +1.4 % memory", 128: "~+1 % speed", 256: "negligible speed, +2.6 % memory"}
SEED_BIAS = {"small batch (one profile)": 10.17, "batch 1000": 28.0}


def log(message: str) -> None:
    print(f"[seed_experiments {time.strftime('%H:%M:%S')}] {message}", flush=True)


def specs(device: str) -> dict[str, DeviceSpec]:
    """The datasheet spec, and the same with the H200 fit's parameters carried over (what
    ``simulate(device=...)`` takes for a GPU without a fit of its own)."""
    datasheet = datasheet_device(device)
    return {"datasheet": datasheet,
            "h200 fit": with_fit(datasheet, FITS_DIR / "h200.json", f"{device} datasheet + the h200 fit's")}


def _scaled_host(spec: DeviceSpec, scale: float) -> DeviceSpec:
    values = {n: scale * getattr(spec, n) for n in HOST_PARAMETERS}
    return with_parameters(spec, values, f"{spec.source}, host costs x{scale:.2f}")


def host_matched(spec: DeviceSpec, predict_ms, target_ms: float) -> DeviceSpec:
    """``spec`` with its host costs scaled (bisection) until ``predict_ms(spec)`` is ``target_ms``."""
    low, high = 0.01, 10.0
    for _ in range(40):
        middle = (low * high) ** 0.5
        if predict_ms(_scaled_host(spec, middle)) < target_ms:
            low = middle
        else:
            high = middle
    return _scaled_host(spec, (low * high) ** 0.5)


def cuda_graph_rows(device: str) -> list[dict]:
    rows = []
    for batch, (seed_without, seed_with) in SEED_GRAPHS_MS.items():
        model, inputs, _ = models.build("resnet50", batch, device="meta", dtype=torch.float16)
        model = model.eval()
        captured = capture(model, inputs)
        variants = dict(specs(device))
        base = variants["h200 fit"]
        rewritten = plan(model, captured, base, False, ["cuda_graphs"], Analytic(base)).graphs

        def without(spec, captured=captured):  # inference: predicted back to back, as the seed timed 1000 batches
            return predict(captured, Analytic(spec), False).time_ms
        variants["h200 fit, host matched to the seed"] = host_matched(base, without, seed_without)
        for label, spec in variants.items():
            before, after = without(spec), predict(captured, Analytic(spec), False, graphs=rewritten).time_ms
            rows.append({"experiment": "cuda_graphs", "model": "resnet50 fp16 inference", "batch": batch,
                         "spec": label, "predicted_without_ms": before, "predicted_with_ms": after,
                         "predicted_time_saved_pct": 100 * (1 - after / before),
                         "seed_without_ms": seed_without, "seed_with_ms": seed_with,
                         "seed_time_saved_pct": 100 * (1 - seed_with / seed_without)})
            log(f"cuda_graphs bs{batch} {label}: {before:.3f} → {after:.3f} ms "
                f"({rows[-1]['predicted_time_saved_pct']:.1f} % less; seed {rows[-1]['seed_time_saved_pct']:.1f} %)")
    return rows


def aux_stream_rows(device: str) -> list[dict]:
    rows = []
    for batch, seed in SEED_AUX.items():
        model, inputs, _ = models.build("resnet50", batch, device="meta")
        net = AutocastLike(model).train()
        captured = capture(net, inputs, training=True)
        for label, spec in specs(device).items():
            planned = plan(net, captured, spec, True, ["aux_stream_backward"], OccupancyAware(Analytic(spec)))
            before, after = planned.before, planned.after
            rows.append({"experiment": "aux_stream_backward", "model": "resnet50 autocast fp16 training",
                         "batch": batch, "spec": label, "predicted_before_ms": before.time_ms,
                         "predicted_after_ms": after.time_ms,
                         "predicted_speedup_pct": 100 * (before.time_ms / after.time_ms - 1),
                         "predicted_memory_change_pct": 100 * (after.peak_memory_bytes / before.peak_memory_bytes - 1),
                         "seed": seed})
            log(f"aux_stream bs{batch} {label}: {rows[-1]['predicted_speedup_pct']:+.2f} % speed, "
                f"{rows[-1]['predicted_memory_change_pct']:+.2f} % memory (seed {seed})")
    return rows


def bias_share_rows(device: str) -> list[dict]:
    rows = []
    for batch in (128, 1000):
        model, inputs, _ = models.build("mnist_convnet", batch, device="meta")
        captured = capture(model.train(), inputs, training=True)
        for label, spec in specs(device).items():
            cost = OccupancyAware(Analytic(spec))
            prediction = predict(captured, cost, True)
            kernels = [t for t in prediction.task_graph.tasks if t.kind is TaskKind.GPU]
            by_node = {n.name: n for part in (captured if isinstance(captured, tuple) else (captured,))
                       for _, gm in part.graphs() for n in gm.graph.nodes}
            bias = sum(cost.bias_gradient_us(by_node[t.fx_node]) for t in kernels if t.fx_node in by_node)
            share = 100 * bias / sum(t.duration_us for t in kernels)
            rows.append({"experiment": "conv bias gradient", "model": "mnist_convnet fp32 training", "batch": batch,
                         "spec": label, "predicted_bias_share_pct": share, "seed_bias_share_pct": SEED_BIAS})
            log(f"bias gradient bs{batch} {label}: {share:.1f} % of GPU time (seed {SEED_BIAS})")
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| experiment | batch | spec | predicted | seed (V100, its own framework) |", "|---|---|---|---|---|"]
    for r in rows:
        if r["experiment"] == "cuda_graphs":
            predicted = (f"{r['predicted_without_ms']:.3f} → {r['predicted_with_ms']:.3f} ms "
                         f"({r['predicted_time_saved_pct']:.1f} % less time)")
            seed = (f"{r['seed_without_ms']:.3f} → {r['seed_with_ms']:.3f} ms "
                    f"({r['seed_time_saved_pct']:.1f} % less time)")
        elif r["experiment"] == "aux_stream_backward":
            predicted = f"{r['predicted_speedup_pct']:+.2f} % speed, {r['predicted_memory_change_pct']:+.2f} % memory"
            seed = r["seed"]
        else:
            predicted = f"{r['predicted_bias_share_pct']:.1f} % of GPU time in bias gradients"
            seed = "10.2 % (small batch), ~28 % (batch 1000)"
        lines.append(f"| {r['experiment']} | {r['batch']} | {r['spec']} | {predicted} | {seed} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="v100", help="the DeviceSpec the seeds ran on")
    parser.add_argument("--out", default=None, help="JSON path (a .md table is written beside it)")
    args = parser.parse_args(argv)
    rows = cuda_graph_rows(args.device) + aux_stream_rows(args.device) + bias_share_rows(args.device)
    out = Path(args.out or RESULTS / f"seed_experiments_{args.device}_predicted_{datetime.date.today()}.json")
    out.write_text(json.dumps({"device": args.device, "predicted": True, "fit": "fxdream/sim/cost/fits/h200.json",
                               "script": "benchmarks/seed_experiments.py", "rows": rows}, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(rows))
    log(f"wrote {out} and {out.with_suffix('.md').name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
