"""Why would fxdream's capture (no pass) run slower than eager on a GPU? Ops and kernels side by side.

For each model and batch (fp16 inference): how the model was captured, the captured forward's
most frequent ops, eager vs capture timed interleaved, and per runner the kernels one call
launches (count, device time, the costliest by torch.profiler) and the ATen calls on the host.
This found transformers' BertModel running SDPA's fp32 math path in the capture (H200,
benchmarks/results/diag_hf_bert_h200_2026-11-26.txt).

    python benchmarks/gpu_capture_vs_eager.py --cases hf_bert:128,hf_bert:1,bert_base:1
"""
from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_ab import build_model  # noqa: E402

import fxdream  # noqa: E402
from fxdream.measure import time_interleaved  # noqa: E402


def kernel_census(fn, inputs, top: int = 8) -> None:
    from torch.profiler import ProfilerActivity, profile
    with torch.no_grad():
        fn(*inputs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            fn(*inputs)
            torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: -e.device_time_total)
    aten = sum(e.count for e in events if e.key.startswith("aten::"))
    print(f"    {sum(e.count for e in kernels)} kernels, {sum(e.device_time_total for e in kernels) / 1e3:.3f} ms "
          f"device, {aten} aten calls on the host")
    for e in kernels[:top]:
        print(f"      {e.device_time_total / 1e3:8.3f} ms  x{e.count:<4} {e.key[:110]}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="hf_bert:128,hf_bert:1,bert_base:1", help="model:batch,...")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_capture_vs_eager needs a CUDA device", file=sys.stderr)
        return 2
    for case in args.cases.split(","):
        name, batch = case.split(":")
        model, inputs = build_model(name, int(batch), torch.float16)
        optimized = fxdream.optimize(model, inputs, passes=[], cost=None)
        report = optimized.report
        print(f"== {name} bs{batch}: capture={report.capture} breaks={list(report.graph_breaks)} "
              f"fallback={report.fallback_reason} graphs={len(optimized.captured)}")
        ops = collections.Counter(str(n.target) for c in optimized.captured for n in c.forward.graph.nodes
                                  if n.op == "call_function")
        print("   ops:", ops.most_common(14))
        with torch.no_grad():
            times = time_interleaved({"eager": lambda: model(*inputs), "capture": lambda: optimized(*inputs)},
                                     rounds=5, block=10, progress=False)
        print("   ms:", {k: round(v.median_ms, 3) for k, v in times.items()})
        for label, fn in (("eager", model), ("capture", optimized)):
            print("   ", label)
            kernel_census(fn, inputs)
        model = optimized = None  # free the GPU memory before the next case
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
