"""Fit the analytic GPU model to measurements of one model and check it on another (held out).

The measurements are the committed results of a GPU lease (``benchmarks/results``); nothing
runs on a GPU here. Every model is captured on the meta device (no data, no kernels) and its
graphs are simulated with a DeviceSpec whose fitted parameters (``FITTABLE``: host cost of a
view and of a kernel launch, the kernel floor, and per kernel class the startup of each kernel
and the share of the roofline it reaches) are searched to match the fit cases
(``fxdream.sim.cost.fitting``). The fit is written to ``fxdream/sim/cost/fits/<device>.json``,
which ``get_device`` then applies.

Fit cases, ResNet-50 in float16 on the H200 (gpu_ab_h200_*, gpu_aux_stream_h200_*):
batch-1 inference as captured (host-bound), in CUDA graphs and fused + CUDA graphs (inference
predicted with calls back to back, as timed: ``fxdream.sim.prediction.iteration_us``), training
steps (forward + backward, no optimizer) at batch 32 and 128 under autocast. Held out, BERT-base
in float16 on the same machine (diag_hf_bert_h200_*): the zoo's bert_base at batch 1 as captured
(wall and device time), and Hugging Face BertModel's eager device time at batch 128 and 1,
against the summed kernels of its captured graph; and models the fit never saw, measured on a
later lease (``UNSEEN``: ResNet-18, VGG-19, DenseNet-121 as captured and in CUDA graphs), with
their per-op records.

    python benchmarks/fit_gpu_model.py --ops benchmarks/results/gpu_op_profile_h200_2026-11-30.json
                                                       # fit, check, write the JSON (~15 min)
    python benchmarks/fit_gpu_model.py --no-write      # whole models only, fit and check

Per-op records (``benchmarks/gpu_op_profile.py``, ``--ops``): each kernel time against the
kernel model of its FLOPs, traffic (``fxdream.ir.flops.kernel_bytes``), dtype, class and kernel
count (records of ``--held-out-ops`` models are checked, not fitted, except those of a kernel
class the fit model has too few long kernels of to set its share: ResNet-50's only GEMM is its
short linear layer, so BERT's GEMM records set the GEMM class, ``borrowed_classes`` in the fit;
each group, whole models and per-op kernels, weighs alike). Each class's startup and share start where its own records
put them (``class_kernel_models``) and are then fitted with the host costs to all cases. Host
times set each kernel class's host cost relative to a pointwise op's (``DeviceSpec.host_factor``,
which scales the launch part: the ratio of the classes' medians, taken as measured); dispatch
and launch are fitted to the whole models, not to the records: an op timed alone in a loop
costs the host less than one called from a captured graph's generated code, whose views (never
in the records) cost dispatch too. The records' host times are then checked.
"""
from __future__ import annotations

import argparse
import ast
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F
from gpu_op_records import (
    LONG_KERNEL_US,
    LONG_KERNELS,
    Case,
    borrowed_classes,
    class_kernel_models,
    host_factors,
    op_cases,
    op_records,
)
from hf_models import LastHidden

from fxdream import models
from fxdream.capturing.capture_model import capture
from fxdream.ir.flops import KERNEL_CLASSES
from fxdream.plan import plan
from fxdream.sim.cost.analytic import Analytic
from fxdream.sim.cost.devices import FITS_DIR, DeviceSpec, datasheet_device, parameters_of, with_parameters
from fxdream.sim.cost.fitting import fit_parameters
from fxdream.sim.cost.occupancy import OccupancyAware
from fxdream.sim.prediction import predict
from fxdream.sim.taskgraph import TaskKind

RESULTS = Path(__file__).parent / "results"
AB = "gpu_ab_h200_2026-11-26_4_resnet50_bs1.json"
AUX = "gpu_aux_stream_h200_2026-11-26.json"
DIAG = "diag_hf_bert_h200_2026-11-26.txt"
# models the fit never saw, measured on a later lease: captured and in CUDA graphs (held out)
UNSEEN = "gpu_ab_h200_2026-11-30_held_out_models.json"
# GNMT is left out of them: on a GPU its capture unrolls each LSTM into per-step ops, which a
# capture on the meta device keeps as one op, so the two captures are not the same program
UNSEEN_MODELS = ("resnet18", "vgg19", "densenet121")
FITTED = ("dispatch_overhead_us", "launch_overhead_us", "kernel_min_us", "roofline_share.conv",
          "roofline_share.batch_norm")
# with per-op records, each class's startup and share start where its records put them
# (class_kernel_models) and are fitted with the host costs and the floor to all cases
FITTED_HOST = ("dispatch_overhead_us", "launch_overhead_us", "kernel_min_us")


def jointly_fitted(per_class: dict[str, float], borrowed=()) -> list[str]:
    """The kernel parameters fitted to the whole models too: those of the classes whose records
    set a share (they have long kernels, and so time in the whole models). A class with short
    kernels only in the fit model (ResNet-50's one linear layer; ``borrowed``: its share set by
    the held-out model's records) keeps what its records give: the fit model's whole steps have
    too few of its kernels to move it."""
    shared = {name.split(".", 1)[1] for name in per_class if name.startswith("roofline_share.")}
    return [name for name in per_class if name.split(".", 1)[1] in shared - set(borrowed)]


def log(message: str) -> None:
    print(f"[fit_gpu_model {time.strftime('%H:%M:%S')}] {message}", flush=True)


def wall_ms(captured, training: bool, graphs=None) -> Callable[[DeviceSpec], float]:
    return lambda spec: predict(captured, Analytic(spec), training, graphs=graphs).time_ms


def device_ms(captured) -> Callable[[DeviceSpec], float]:
    """Summed kernel time: what a profiler's "device time" of the step adds up."""
    def predicted(spec: DeviceSpec) -> float:
        graph = predict(captured, Analytic(spec), False).task_graph
        return sum(t.duration_us for t in graph.tasks if t.kind is TaskKind.GPU) / 1e3
    return predicted


class AutocastLike(torch.nn.Module):
    """torch.autocast(float16)'s effect on a conv net, for capture on the meta device (where
    autocast does not run): convolutions and linears cast input, weight and bias to float16
    each call; the parameters stay float32, so their gradients are cast back in backward."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model
        for module in model.modules():
            if isinstance(module, (torch.nn.Conv2d, torch.nn.Linear)):
                module.forward = _half_forward(module)

    def forward(self, *inputs):
        return self.model(*inputs)


def _half_forward(module):
    def forward(x):
        bias = module.bias.half() if module.bias is not None else None
        if isinstance(module, torch.nn.Linear):
            return F.linear(x.half(), module.weight.half(), bias)
        return F.conv2d(x.half(), module.weight.half(), bias, module.stride, module.padding, module.dilation,
                        module.groups)
    return forward


def _meta_model(name: str, batch: int, training: bool, dtype=torch.float16):
    model, inputs, _ = models.build(name, batch, device="meta", dtype=dtype)
    return (model.train() if training else model.eval()), inputs


def resnet50_cases(base: DeviceSpec) -> list[Case]:
    ab = json.loads((RESULTS / AB).read_text())["cases"][0]["runners"]
    aux = {r["batch"]: r for r in json.loads((RESULTS / AUX).read_text())["rows"] if r["dtype"] == "fp16"}
    model, inputs = _meta_model("resnet50", 1, False)
    captured = capture(model, inputs)
    cases = [Case("resnet50 fp16 bs1 inference, captured", ab["capture"]["median_ms"], wall_ms(captured, False), AB)]
    variants = (("cuda_graphs", ["cuda_graphs"]), ("fuse+cuda_graphs", ["fuse_conv_bias_act", "cuda_graphs"]))
    for runner, passes in variants:
        rewritten = plan(model, captured, base, False, passes, Analytic(base)).graphs
        cases.append(Case(f"resnet50 fp16 bs1 inference, {runner}", ab[runner]["median_ms"],
                          wall_ms(captured, False, rewritten), AB))
    for batch in sorted(aux):
        model, inputs = _meta_model("resnet50", batch, True, dtype=torch.float32)
        captured = capture(AutocastLike(model).train(), inputs, training=True)
        cases.append(Case(f"resnet50 autocast fp16 bs{batch} training step (no optimizer)",
                          aux[batch]["measured_baseline_ms"], wall_ms(captured, True), AUX))
    return cases


def unseen_cases(base: DeviceSpec) -> list[Case]:
    """Held out: each zoo model of the later lease's A/B run (``UNSEEN``), as captured and in
    CUDA graphs, at the batches it reached."""
    cases = []
    for row in json.loads((RESULTS / UNSEEN).read_text())["cases"]:
        name, batch, runners = row["model"], row["batch"], row["runners"]
        if name not in UNSEEN_MODELS or row["dtype"] != "fp16":
            continue
        model, inputs = _meta_model(name, batch, False)
        captured = capture(model, inputs)
        cases.append(Case(f"{name} fp16 bs{batch} inference, captured", runners["capture"]["median_ms"],
                          wall_ms(captured, False), UNSEEN))
        if "cuda_graphs" in runners:
            rewritten = plan(model, captured, base, False, ["cuda_graphs"], Analytic(base)).graphs
            cases.append(Case(f"{name} fp16 bs{batch} inference, cuda_graphs", runners["cuda_graphs"]["median_ms"],
                              wall_ms(captured, False, rewritten), UNSEEN))
    return cases


def _diag_sections() -> dict[str, dict]:
    """{"hf_bert bs128": {"eager_ms", "capture_ms", "eager_device_ms", "capture_device_ms"}} from the diag text."""
    sections, current = {}, None
    for line in (RESULTS / DIAG).read_text().splitlines():
        head = re.match(r"== (\S+ bs\d+):", line)
        if head:
            current = sections.setdefault(head.group(1), {"device_ms": []})
        elif current is not None and line.strip().startswith("ms:"):
            current.update({f"{k}_ms": v for k, v in ast.literal_eval(line.split("ms:", 1)[1].strip()).items()})
        elif current is not None and "ms device" in line:
            current["device_ms"].append(float(re.search(r"([\d.]+) ms device", line).group(1)))
    return {k: {**v, "eager_device_ms": v["device_ms"][0], "capture_device_ms": v["device_ms"][1]}
            for k, v in sections.items()}


def bert_cases() -> list[Case]:
    diag = _diag_sections()
    model, inputs = _meta_model("bert_base", 1, False)
    captured = capture(model, inputs)
    measured = diag["bert_base bs1"]
    cases = [Case("bert_base fp16 bs1 inference, captured (wall)", measured["capture_ms"], wall_ms(captured, False),
                  DIAG),
             Case("bert_base fp16 bs1 inference, captured (device)", measured["capture_device_ms"],
                  device_ms(captured), DIAG)]
    try:
        import transformers
    except ImportError:
        log("transformers is not installed: the Hugging Face BERT cases are left out")
        return cases
    for batch in (128, 1):
        with torch.device("meta"):
            hf = LastHidden(transformers.BertModel(transformers.BertConfig())).to(torch.float16).eval()
        ids = torch.zeros(batch, 128, dtype=torch.long, device="meta")
        captured = capture(hf, (ids,))
        cases.append(Case(f"HF BertModel fp16 bs{batch} seq128, device time (eager measured)",
                          diag[f"hf_bert bs{batch}"]["eager_device_ms"], device_ms(captured), DIAG))
    return cases


def evaluate(cases: list[Case]) -> Callable[[DeviceSpec], list[float]]:
    return lambda spec: [case.predict_ms(spec) for case in cases]


def aux_stream_signs(base: DeviceSpec, fitted: DeviceSpec) -> list[dict]:
    """aux_stream_backward's predicted change against the measured one (the sign is the check)."""
    rows = []
    for r in (r for r in json.loads((RESULTS / AUX).read_text())["rows"] if r["dtype"] == "fp16"):
        model, inputs = _meta_model("resnet50", r["batch"], True, dtype=torch.float32)
        net = AutocastLike(model).train()
        captured = capture(net, inputs, training=True)
        row = {"case": f"aux_stream_backward, resnet50 autocast fp16 bs{r['batch']} training",
               "measured_change_pct": r["measured_delta_pct"]}
        for label, spec in (("datasheet", base), ("fitted", fitted)):
            cost = OccupancyAware(Analytic(spec))
            planned = plan(net, captured, spec, True, ["aux_stream_backward"], cost)
            row[f"predicted_change_pct_{label}"] = 100 * (planned.after.time_ms / planned.before.time_ms - 1)
        rows.append(row)
    return rows


def pass_sign(name: str, cases: list[Case], predicted, before: str, after: str) -> dict:
    """The measured and predicted change between the two fit cases whose names end in ``before``/``after``."""
    index = {c.name.rsplit(", ", 1)[-1]: i for i, c in enumerate(cases)}
    b, a = index[before], index[after]
    return {"case": name, "measured_change_pct": 100 * (cases[a].measured_ms / cases[b].measured_ms - 1),
            "predicted_change_pct_fitted": 100 * (predicted[a] / predicted[b] - 1)}


def table(cases: list[Case], before: list[float], after: list[float]) -> list[dict]:
    return [{"case": c.name, "measured_ms": c.measured_ms, "datasheet_ms": b, "fitted_ms": a,
             "datasheet_error_pct": 100 * (b / c.measured_ms - 1), "fitted_error_pct": 100 * (a / c.measured_ms - 1),
             "source": f"benchmarks/results/{c.source}"} for c, b, a in zip(cases, before, after)]


def weights_of(cases: list[Case]) -> list[float]:
    """Each group of cases (whole models, per-op kernels, per-op host times) weighs as much in
    all as the largest group: hundreds of op records do not drown five model times."""
    sizes: dict[str, int] = {}
    for case in cases:
        sizes[case.group] = sizes.get(case.group, 0) + 1
    largest = max(sizes.values())
    return [largest / sizes[case.group] for case in cases]


def error_summary(cases: list[Case], before: list[float], after: list[float]) -> dict:
    """Median |error| % by op and group ("aten.convolution kernel")."""
    kinds: dict[str, list[tuple[float, float]]] = {}
    for case, b, a in zip(cases, before, after):
        kinds.setdefault(f"{case.op} {case.group}", []).append((b / case.measured_ms - 1, a / case.measured_ms - 1))
    def median_pct(values):
        return 100 * statistics.median(abs(v) for v in values)
    return {kind: {"cases": len(errors), "datasheet_median_abs_error_pct": median_pct(b for b, _ in errors),
                   "fitted_median_abs_error_pct": median_pct(a for _, a in errors)}
            for kind, errors in sorted(kinds.items())}


def not_fitted(names) -> str | None:
    """Which kernel classes keep the datasheet's share of the roofline, and why."""
    kept = [c for c in KERNEL_CLASSES if f"roofline_share.{c}" not in names]
    if not kept:
        return None
    return (f"the share of {', '.join(kept)} stays the datasheet's 1.0: per-op records (the fit model's, or the "
            f"held-out model's for a class the fit model lacks) set a class's share only from {LONG_KERNELS}+ "
            f"kernels of {LONG_KERNEL_US:g}+ µs of roofline time, and whole models alone cannot tell the classes' "
            "kernels apart")


def log_rows(report: dict) -> None:
    for section in ("fit", "held_out"):
        for row in report.get(section, []):
            log(f"{section:8} {row['case'][:62]:62} measured {row['measured_ms']:8.3f}  datasheet "
                f"{row['datasheet_ms']:8.3f} ({row['datasheet_error_pct']:+6.1f} %)  fitted {row['fitted_ms']:8.3f} "
                f"({row['fitted_error_pct']:+6.1f} %)")
    for row in report.get("pass_signs", []):
        log(f"sign     {row['case'][:62]:62} measured {row['measured_change_pct']:+7.1f} %  predicted (fitted) "
            f"{row['predicted_change_pct_fitted']:+7.1f} %")
    log("parameters: " + ", ".join(f"{k} {v:.3g}" for k, v in report["parameters"].items()))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="h200", help="the DeviceSpec the measurements ran on")
    parser.add_argument("--parameters", default=None,
                        help="the FITTABLE parameters to fit (default: the host costs and the kernel floor, and "
                             "the startup and share of each class with per-op records; without records the conv "
                             "and batch-norm shares)")
    parser.add_argument("--ops", action="append", default=[], help="a gpu_op_profile.py file (repeatable)")
    parser.add_argument("--held-out-ops", default="bert_base,resnet18,vgg19,densenet121,gnmt",
                        help="models whose per-op cases are checked, not fitted (comma-separated)")
    parser.add_argument("--no-models", action="store_true", help="per-op cases only (no whole-model cases)")
    parser.add_argument("--out", default=None, help="the fit's path (default fxdream/sim/cost/fits/<device>.json)")
    parser.add_argument("--no-write", action="store_true", help="do not write the fit")
    args = parser.parse_args(argv)
    held_models = tuple(args.held_out_ops.split(","))
    records = op_records(args.ops)
    factors = host_factors([r for rs in records.values() for r in rs], held_models)
    base = with_parameters(datasheet_device(args.device), factors)
    if factors:
        log("host cost per op over a pointwise op's, from the records: "
            + ", ".join(f"{k.split('.', 1)[1]} {v:.2f}x" for k, v in factors.items()))
    fit_cases, held_cases = [], []
    if not args.no_models:
        log(f"capturing ResNet-50 (fit), BERT and {', '.join(UNSEEN_MODELS)} (held out) on the meta device")
        fit_cases, held_cases = resnet50_cases(base), bert_cases() + unseen_cases(base)
    all_records = [r for rs in records.values() for r in rs]
    fit_records = [r for r in all_records if not r["case"].startswith(held_models)]
    held_records = [r for r in all_records if r["case"].startswith(held_models)]
    borrowed = borrowed_classes(base, fit_records, held_records)
    fit_records += [r for r in held_records if r["class"] in borrowed]
    for kernel_class, why in borrowed.items():
        log(f"{kernel_class}: {why}")
    ops = [c for source, rs in records.items() for c in op_cases(source, rs)]
    op_fit = [c for c in ops if c.group == "kernel" and not c.name.startswith(held_models)]
    # the held-out model's kernels of a borrowed class: they set that class (``class_kernel_models``),
    # are reported apart, and take no part in the joint fit, whose other parameters they do not tell
    op_borrowed = [c for c in ops if c.group == "kernel" and c.name.startswith(held_models)
                   and c.kernel_class in borrowed]
    taken = set(map(id, op_fit + op_borrowed))
    op_held = [c for c in ops if id(c) not in taken]
    cases = fit_cases + op_fit
    if not cases:
        parser.error("nothing to fit: give --ops files or leave out --no-models")
    weights = weights_of(cases)
    per_class = class_kernel_models(base, fit_records)
    default = (*FITTED_HOST, *jointly_fitted(per_class, borrowed)) if per_class else FITTED
    names = tuple(args.parameters.split(",")) if args.parameters else default
    start = with_parameters(base, per_class)
    if per_class:
        log("each class's kernel model, from its per-op records: " + ", ".join(f"{k} {v:.3g}"
                                                                            for k, v in per_class.items()))
    log(f"fitting {', '.join(names)} to {len(fit_cases)} model and {len(op_fit)} per-op cases")
    before = evaluate(cases)(base)
    result = fit_parameters(start, names, evaluate(cases), [c.measured_ms for c in cases], weights=weights,
                            progress=lambda n, e: log(f"  {n} evaluations, error {e:.4f}") if n % 40 < 6 else None)
    fitted = with_parameters(start, result.parameters)
    held_before, held_after = evaluate(held_cases + op_held)(base), evaluate(held_cases + op_held)(fitted)
    n_fit, n_held = len(fit_cases), len(held_cases)
    report = {
        "device": args.device,
        "fitted_on": " + ".join(filter(None, ["ResNet-50 fp16 measured on an H200 (PyTorch 2.11, CUDA 13)"
                                              if fit_cases else "", *args.ops])),
        "parameters": {**{k: round(v, 4) for k, v in {**per_class, **result.parameters}.items()}, **factors},
        "kernel_model_source": "each class's startup and share started from its per-op kernel records alone "
                               f"(the share only for classes with {LONG_KERNELS}+ kernels of {LONG_KERNEL_US:g}+ µs), "
                               "then fitted with the host costs to all cases" if per_class else None,
        "host_factor_source": "medians of the per-op records' host µs by kernel class (models not held out)"
                              if factors else None,
        "borrowed_classes": borrowed or None,
        "datasheet_parameters": parameters_of(base, names),
        "not_fitted": not_fitted([*names, *per_class]),
        "fit": table(fit_cases, before[:n_fit], list(result.predicted_ms[:n_fit])),
        "held_out": table(held_cases, held_before[:n_held], held_after[:n_held]),
        "evaluations": result.evaluations,
        "script": "benchmarks/fit_gpu_model.py",
    }
    if ops:
        report["per_op_fit"] = error_summary(op_fit, before[n_fit:], list(result.predicted_ms[n_fit:]))
        report["per_op_held_out"] = error_summary(op_held, held_before[n_held:], held_after[n_held:])
    if op_borrowed:
        report["per_op_borrowed"] = error_summary(op_borrowed, evaluate(op_borrowed)(base),
                                                  evaluate(op_borrowed)(fitted))
    if fit_cases:
        report["pass_signs"] = aux_stream_signs(base, fitted) + [
            pass_sign("cuda_graphs, resnet50 fp16 bs1", fit_cases, result.predicted_ms, "captured", "cuda_graphs"),
            pass_sign("fuse_conv_bias_act in CUDA graphs, resnet50 fp16 bs1", fit_cases, result.predicted_ms,
                      "cuda_graphs", "fuse+cuda_graphs")]
    log_rows(report)
    if not args.no_write:
        path = Path(args.out) if args.out else FITS_DIR / f"{args.device}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1) + "\n")
        log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
