"""Per-op measurements for fitting the analytic GPU model (``benchmarks/fit_gpu_model.py --ops``).

For each zoo model x batch x dtype x mode (inference; training: forward and backward graphs),
the model is captured on this machine's device and every op of its graphs is timed alone at
its shapes with ``Profiled`` (blocks of calls, median of rounds): its kernel µs, its host µs
(dispatch + launch) and, on a GPU, its kernel replayed from a CUDA graph. One record per
distinct op key: op, kernel class, dtype, output shape, FLOPs and bytes (what the roofline
needs), how many nodes of the case's graphs share the key, and the measurements (on a GPU also
the memory the op allocates beyond its inputs). Run on every GPU lease (``scripts/gpu_session.sh``, step
``ops``); on a CPU it runs the same way (host and kernel are one time there), which is how
its tests run it.

    python benchmarks/gpu_op_profile.py --models resnet50,bert_base --batches 1,8,32,128 --dtypes fp16,fp32
    python benchmarks/gpu_op_profile.py --device cpu --models mnist_convnet --batches 1 --tiny
"""
from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from collections import Counter
from pathlib import Path

import torch

from fxdream import models
from fxdream.capturing.capture_model import capture
from fxdream.ir.flops import kernel_class, node_flops
from fxdream.ir.nodes import is_view, node_bytes, node_dtype, op_name
from fxdream.runtime.direct_calls import direct
from fxdream.sim.cost.devices import get_device
from fxdream.sim.cost.profiled import Profiled
from fxdream.sim.prediction import this_machine_device
from fxdream.sim.profile.in_context import synthetic_args
from fxdream.sim.profile.op_keys import profile_key

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo_cases import DTYPES  # noqa: E402  (benchmarks/: the dtypes by name)

RESULTS = Path(__file__).parent / "results"


def log(message: str) -> None:
    print(f"[gpu_op_profile {time.strftime('%H:%M:%S')}] {message}", flush=True)


def cuda_op_memory(node, device: torch.device) -> dict:
    """What one call of ``node``'s op allocates beyond its inputs, by torch's caching allocator:
    ``transient_bytes`` (freed before it returns: cuDNN / cuBLAS workspaces, split-K sums) and
    ``kept_bytes`` (still held after it, outputs included). The second call is the one read, so
    a handle's one-time workspace is not counted."""
    args, kwargs = synthetic_args(node, device)
    op = direct(node.target)
    op(*args, **kwargs)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    result = op(*args, **kwargs)
    torch.cuda.synchronize()
    after = torch.cuda.memory_allocated()
    peak = torch.cuda.max_memory_allocated()
    del result
    return {"transient_bytes": peak - after, "kept_bytes": after - before}


def op_records(captured, cost: Profiled, device_type: str, case: str, budget_end: float) -> list[dict]:
    """One record per distinct op key of ``captured``'s graphs, timed alone."""
    records, seen = [], set()
    parts = captured if isinstance(captured, tuple) else (captured,)
    # how many nodes of the case's graphs share each key: a record times one, the graphs run all
    counts = Counter(profile_key(node, device_type) for part in parts for _, gm in part.graphs()
                     for node in gm.graph.nodes if node.op == "call_function" and not is_view(node))
    for part in parts:
        for phase, gm in part.graphs():
            for node in gm.graph.nodes:
                if node.op != "call_function" or is_view(node) or time.perf_counter() > budget_end:
                    continue
                key = profile_key(node, device_type)
                if key in seen:
                    continue
                seen.add(key)
                kernel = cost.isolated_us(node)
                value = node.meta.get("val")
                memory = {}
                if device_type == "cuda":
                    try:
                        memory = cuda_op_memory(node, torch.device(device_type))
                    except Exception as error:  # an op that cannot run on synthetic inputs: no memory reading
                        memory = {"memory_error": f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"}
                records.append({
                    "case": case, "phase": phase, "op": op_name(node), "class": kernel_class(node),
                    "dtype": node_dtype(node), "shape": list(value.shape) if isinstance(value, torch.Tensor) else None,
                    "flops": int(node_flops(node)), "bytes": int(node_bytes(node)), "kernel_us": kernel,
                    "host_us": cost.host_us(node) if device_type == "cuda" else None,
                    "in_graph_us": cost.graph_kernel_us(node) if device_type == "cuda" else None,
                    # the kernel less a replay's saving per kernel, before graph_kernel_us's floor (the
                    # spec's fitted kernel_min_us, which a fit of that floor must not read back)
                    "in_graph_unfloored_us": kernel - cost.graph_saving_us() if device_type == "cuda" else None,
                    "count": counts[key], "key": key, **memory})
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--models", default="resnet50,bert_base")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--dtypes", default="fp16,fp32")
    parser.add_argument("--modes", default="infer,train")
    parser.add_argument("--tiny", action="store_true", help="the models' tiny configurations")
    parser.add_argument("--budget-s", type=float, default=240.0, help="stop timing new ops after this long")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    spec_name = this_machine_device(args.device)
    budget_end = time.perf_counter() + args.budget_s
    records, skipped = [], []
    # dtype, then batch, outermost: a budget that runs out still leaves every model at several batches
    for dtype_name in args.dtypes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for name in args.models.split(","):
                for mode in args.modes.split(","):
                    case = f"{name} {dtype_name} bs{batch} {mode}"
                    if time.perf_counter() > budget_end:
                        skipped.append(f"{case}: time budget spent")
                        continue
                    try:
                        model, inputs, _ = models.build(name, batch, tiny=args.tiny, device=args.device,
                                                        dtype=DTYPES[dtype_name])
                        training = mode == "train"
                        captured = capture(model.train() if training else model.eval(), inputs, training=training)
                        cost = Profiled(get_device(spec_name), args.device)
                        found = op_records(captured, cost, torch.device(args.device).type, case, budget_end)
                    except Exception as error:  # one case's failure (memory, an op) costs that case only
                        skipped.append(f"{case}: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
                        log(f"{case}: skipped ({skipped[-1]})")
                        continue
                    records += found
                    log(f"{case}: {len(found)} op keys, {sum(r['kernel_us'] for r in found) / 1e3:.2f} ms of kernels")
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
    device_name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    out = Path(args.out or RESULTS / f"gpu_op_profile_{spec_name}_{datetime.date.today()}.json")
    out.write_text(json.dumps({"device": device_name, "spec": spec_name, "torch": torch.__version__,
                               "date": str(datetime.date.today()), "records": records, "skipped": skipped},
                              indent=0) + "\n")
    log(f"wrote {len(records)} records to {out}" + (f"; skipped {len(skipped)}" if skipped else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
