"""ResNet-50 inference on CPU: eager vs fxdream's fuse_conv_bias_act (measured, interleaved).

    python benchmarks/fuse_cpu.py [--batch 1 8] [--inductor] [--threads N] [--out results.json]
                                  [--device cuda]   (the same comparison for the cuDNN path)

Runners, timed with ``fxdream.measure.time_interleaved`` (median of 5 rounds of 10-call
blocks, alternated in one process): eager; the fxdream capture without passes (what the
pass's "unfused" prediction describes); the capture with fuse_conv_bias_act (the pass
picks its variant by the Profiled cost model); optionally torch.compile (inductor, default
and with freezing). Prints each runner's median, its ratio to eager, the pass's reason and
notes, and predicted vs measured for the pass.
"""
from __future__ import annotations

import argparse
import json
import platform
import time

import torch

import fxdream
from fxdream import models
from fxdream.measure import time_interleaved

PASS = "fuse_conv_bias_act"


class ForcedVariant:
    """The pass with its variant fixed (to measure every variant the pass predicted)."""

    def __init__(self, variant):
        self.variant, self.name = variant, f"{PASS}[{variant.name}]"

    def applies_to(self, ctx):
        return None if ctx.phase == "fw" else "forward only"

    def __call__(self, gm, ctx):
        from fxdream.passes.fuse_conv_bias_act import FuseConvBiasAct
        return fxdream.PassResult(FuseConvBiasAct._build(gm, ctx, self.variant), True, self.variant.name)


def _timed_build(make):
    started = time.perf_counter()
    runner = make()
    return runner, time.perf_counter() - started


def _inductor(model, inputs, freezing: bool):
    from cpu_ab import compile_inductor  # benchmarks/ is on sys.path when this script runs
    return compile_inductor(model, inputs, freezing)


def bench(batch: int, inductor: bool, rounds: int, block: int, device: str = "cpu", variants: bool = False) -> dict:
    model, inputs, _ = models.build("resnet50", batch, device=device)
    model.eval()
    builds, runners = {}, {}
    capture_only, builds["capture"] = _timed_build(lambda: fxdream.optimize(model, inputs, cost=None))
    optimized, builds[PASS] = _timed_build(lambda: fxdream.optimize(model, inputs, passes=[PASS]))
    runners = {"eager": model, "capture": capture_only, PASS: optimized}
    if variants:
        from fxdream.passes.fuse_conv_bias_act import _variants
        for v in _variants(fxdream.PassContext(device=device), device):
            runners[v.name], builds[v.name] = _timed_build(
                lambda: fxdream.optimize(model, inputs, passes=[ForcedVariant(v)], cost=None))
    if inductor:
        runners["inductor"], builds["inductor"] = _timed_build(lambda: _inductor(model, inputs, False))
        runners["inductor freezing"], builds["inductor freezing"] = _timed_build(lambda: _inductor(model, inputs, True))
    with torch.no_grad():
        expected = model(*inputs)
        errors = {name: (r(*inputs) - expected).abs().max().item() for name, r in runners.items()}

    def call(r):
        def run():
            with torch.no_grad():
                r(*inputs)
        return run
    times = time_interleaved({name: call(r) for name, r in runners.items()}, rounds=rounds, block=block,
                             desc=f"resnet50 bs{batch}")
    row = next(r for r in optimized.report.passes if r.phase == "fw")
    predicted = next((n for n in row.notes if n.startswith("predicted:")), "")
    eager_ms = times["eager"].median_ms
    where = torch.cuda.get_device_name() if device == "cuda" else f"{torch.get_num_threads()} threads"
    print(f"\nResNet-50 inference, batch {batch}, {device} ({where}), torch {torch.__version__} "
          f"(measured: median of {rounds} rounds x {block} calls, interleaved)")
    print(f"{'runner':<24} {'ms':>9} {'vs eager':>9} {'spread':>7} {'build s':>8} {'max abs diff':>13}")
    for name, m in times.items():
        build = f"{builds[name]:.1f}" if name in builds else "-"
        print(f"{name:<24} {m.median_ms:9.2f} {eager_ms / m.median_ms:8.2f}x {m.spread_pct:6.1f}% {build:>8} "
              f"{errors[name]:13.2e}")
    print(f"pass: {row.reason}")
    print(f"  {predicted}")
    pred_ratio = measured_ratio = None
    if optimized.report.predicted_baseline_ms:
        pred_ratio = optimized.report.predicted_baseline_ms / optimized.report.predicted_optimized_ms
        measured_ratio = times["capture"].median_ms / times[PASS].median_ms
        print(f"  predicted (whole model): capture {optimized.report.predicted_baseline_ms:.2f} ms → "
              f"{optimized.report.predicted_optimized_ms:.2f} ms ({pred_ratio:.2f}x); measured: capture "
              f"{times['capture'].median_ms:.2f} ms → {times[PASS].median_ms:.2f} ms ({measured_ratio:.2f}x)")
    for note in row.notes[:6]:
        if note != predicted:
            print(f"  note: {note}")
    return dict(batch=batch, device=device, threads=torch.get_num_threads(), torch=torch.__version__,
                machine=platform.node(),
                median_ms={k: v.median_ms for k, v in times.items()},
                spread_pct={k: v.spread_pct for k, v in times.items()},
                vs_eager={k: eager_ms / v.median_ms for k, v in times.items()},
                build_seconds=builds, max_abs_diff=errors, reason=row.reason, predicted=predicted,
                predicted_ratio=pred_ratio, measured_ratio=measured_ratio)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--inductor", action="store_true", help="also time torch.compile (slow to build)")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=10)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--variants", action="store_true", help="also time every variant, forced")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    results = [bench(b, args.inductor, args.rounds, args.block, args.device, args.variants) for b in args.batch]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
