"""The simulator's predicted peak memory against the peak measured for the same step.

For each zoo model × batch × inference (and, with --modes infer,train, training steps without an
optimizer): ``simulate`` (no passes, no optimizer) predicts the peak above the static memory
(weights and inputs), and the captured module's step is measured two ways (``fxdream.memory_check``):
the op outputs (each op's net allocation at its start; it misses the temporaries an op frees
before returning and, in training, the compiled backward's frees) and every allocation the CPU
allocator made, workspaces inside ops included: the check, as the simulator holds the workspaces
it knows (``fxdream.sim.workspaces``). Gradients are cleared before each measured step, so all
count the gradients the step makes.

On a GPU (``--device cuda``) the prediction is for this GPU's DeviceSpec and the measurement is
``torch.cuda.max_memory_allocated`` over the step (every allocation, cuDNN/cuBLAS workspaces
included): both readings are that one.

    python benchmarks/memory_check.py --out benchmarks/results/memory_check_cpu_<date>
    python benchmarks/memory_check.py --device cuda --dtype fp16 --modes infer,train --out out/memory_check_gpu
"""
from __future__ import annotations

import argparse
import datetime
import statistics
import sys
from pathlib import Path

import torch

import fxdream
from fxdream import models
from fxdream.memory_check import allocated_peak_bytes_during, peak_bytes_during
from fxdream.sim.prediction import this_machine_device

sys.path.insert(0, str(Path(__file__).resolve().parent))
from zoo_cases import DTYPES, device_name, run_cases  # noqa: E402  (benchmarks/: the case loop)

MIB = 2**20


def one_row(name: str, batch: int, training: bool, tiny: bool, device: str = "cpu", dtype: str = "fp32") -> dict:
    model, inputs, _ = models.build(name, batch, tiny=tiny, device=device, dtype=DTYPES[dtype])
    model.train(training)
    predicted = fxdream.simulate(model, inputs, device=this_machine_device(device), training=training,
                                 cost="analytic", optimizer=None)
    captured = fxdream.optimize(model, inputs, training=training, cost=None)
    if training:
        output_grad = torch.ones_like(captured(*inputs))

        def step():
            captured(*inputs).backward(output_grad)
    else:
        def step():
            with torch.no_grad():
                captured(*inputs)
    step()
    measured = {}
    readings = ((("op_outputs", peak_bytes_during), ("allocated", allocated_peak_bytes_during)) if device == "cpu"
                else (("op_outputs", lambda s: peak_bytes_during(s, device)),))
    for reading, measure in readings:
        for p in model.parameters():
            p.grad = None
        measured[reading] = measure(step)
    measured.setdefault("allocated", measured["op_outputs"])  # a GPU's one reading is every allocation
    checked = measured["allocated"]  # what the step held, op workspaces included
    above_static = predicted.peak_memory_bytes - predicted.static_bytes
    return dict(model=name, batch=batch, training=training, tiny=tiny, device=device, dtype=dtype,
                static_mib=predicted.static_bytes / MIB,
                predicted_peak_mib=above_static / MIB, measured_peak_mib=measured["op_outputs"] / MIB,
                allocated_peak_mib=measured["allocated"] / MIB,
                error_pct=100 * (above_static / checked - 1) if checked else None)


def to_markdown(rows: list[dict]) -> str:
    lines = ["| model | batch | mode | config | static MiB | predicted peak MiB | measured: op outputs MiB "
             "| measured: every allocation MiB | error (against every allocation) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        error = "–" if r["error_pct"] is None else f"{r['error_pct']:+.1f} %"
        lines.append(f"| {r['model']} | {r['batch']} | {'train' if r['training'] else 'infer'} | "
                     f"{'tiny' if r['tiny'] else 'full'} {r.get('dtype', 'fp32')} | "
                     f"{r['static_mib']:.1f} | {r['predicted_peak_mib']:.2f} | "
                     f"{r['measured_peak_mib']:.2f} | {r['allocated_peak_mib']:.2f} | {error} |")
    for mode in (False, True):
        errors = [abs(r["error_pct"]) for r in rows if r["training"] == mode and r["error_pct"] is not None]
        if errors:
            lines.append(f"\n{'training' if mode else 'inference'}: mean |error| {statistics.mean(errors):.1f} %, "
                         f"max {max(errors):.1f} % over {len(errors)} rows")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(models.NAMES))
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--modes", default="infer")
    parser.add_argument("--tiny", action="store_true", help="the tiny configurations")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda: this GPU's DeviceSpec and its allocator")
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    parser.add_argument("--out", default=f"benchmarks/results/memory_check_cpu_{datetime.date.today().isoformat()}")
    args = parser.parse_args(argv)
    def after_row(row):
        if args.device != "cpu":
            torch.cuda.empty_cache()
    rows = run_cases(args.models, args.batches, args.modes,
                     lambda name, batch, training: one_row(name, batch, training, args.tiny, args.device, args.dtype),
                     args.out, {"torch": torch.__version__, "device": device_name(args.device)}, to_markdown,
                     after_row)
    print(to_markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
