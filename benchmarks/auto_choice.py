"""Does passes="auto" pick the subset that is really fastest? Measured on this machine.

For each zoo model × batch × mode: every subset of --passes is applied by name (forced) and
timed beside optimize(passes="auto"), interleaved in one process (median of rounds of
blocks). The row says which subset auto chose from its predictions, the measured time of
every subset, and how far auto's choice is from the best measured one (target: within 2 %).
Subsets whose passes changed the same graphs (a pass with nothing to do changes none) are one
candidate, their times averaged: "choice vs best" compares auto's candidate, timed as its
forced subsets (so a second build's noise does not enter; auto's own module where it ran
eagerly), with the fastest candidate; "auto module vs best subset" times auto's own module.

    python benchmarks/auto_choice.py --models resnet50,bert_base --batches 1,32 \\
        --out benchmarks/results/auto_choice_cpu_<date>

On a CPU only fuse_conv_bias_act can apply: cuda_graphs needs a CUDA device and
aux_stream_backward has no concurrent streams there (auto declines both, with that reason),
so its default --passes is fuse_conv_bias_act alone. A full-size model whose eager step
takes longer than --max-step-s is run in its tiny configuration (marked in the table).
"""
from __future__ import annotations

import argparse
import datetime
import itertools
import json
import platform
import time

import torch

import fxdream
from fxdream import models
from fxdream.ab import step_fn
from fxdream.measure import time_interleaved


def subsets(names: list[str]) -> list[tuple[str, ...]]:
    return [c for k in range(len(names) + 1) for c in itertools.combinations(names, k)]


def label(subset: tuple[str, ...]) -> str:
    return "+".join(subset) if subset else "(none)"


def _eager_step_s(model, inputs, loss_fn, training: bool) -> float:
    step = step_fn(model, inputs, loss_fn, training)
    step()
    started = time.perf_counter()
    step()
    return time.perf_counter() - started


def run_case(name: str, batch: int, training: bool, passes: list[str], rounds: int, block: int,
             max_step_s: float) -> dict:
    tiny = False
    model, inputs, loss_fn = models.build(name, batch)
    model.train(training)
    if _eager_step_s(model, inputs, loss_fn, training) > max_step_s:
        tiny = True
        model, inputs, loss_fn = models.build(name, batch, tiny=True)
        model.train(training)
    built = {label(s): fxdream.optimize(model, inputs, passes=list(s), training=training) for s in subsets(passes)}
    started = time.perf_counter()
    auto = fxdream.optimize(model, inputs, passes="auto", training=training)
    auto_build_s = time.perf_counter() - started
    chosen = tuple(dict.fromkeys(p.name for p in auto.report.passes if p.applied and p.name in passes))
    runners = {key: step_fn(m, inputs, loss_fn, training) for key, m in built.items()}
    runners["auto"] = step_fn(auto, inputs, loss_fn, training)
    measured = time_interleaved(runners, rounds=rounds, block=block,
                                desc=f"{name} bs{batch} {'train' if training else 'infer'}")
    best = min((k for k in measured if k != "auto"), key=lambda k: measured[k].median_ms)
    auto_ms, best_ms = measured["auto"].median_ms, measured[best].median_ms
    # subsets whose passes changed the same graphs (a pass that found nothing to do changes
    # none) are one candidate: their times differ by noise only, so they are averaged
    applied = {key: label(tuple(p for p in passes if any(r.applied and r.name == p for r in m.report.passes)))
               for key, m in built.items()}
    candidate_ms = {c: sum(measured[k].median_ms for k in applied if applied[k] == c)
                    / sum(1 for k in applied if applied[k] == c) for c in set(applied.values())}
    best_candidate = min(candidate_ms, key=candidate_ms.get)
    # auto's choice timed as its forced subsets (the same graphs: no noise of another build);
    # where auto ran eagerly (eager_check), its own module is what the user gets
    choice_ms = auto_ms if auto.report.ran_eagerly else candidate_ms[label(chosen)]
    return {"model": name, "tiny": tiny, "batch": batch, "training": training, "auto_chose": label(chosen),
            "auto_ran_eagerly": auto.report.ran_eagerly,  # eager_check: eager measured faster
            "best_measured": best, "auto_vs_best_pct": 100.0 * (auto_ms - best_ms) / best_ms,
            "best_candidate": best_candidate, "applied": applied, "candidate_ms": candidate_ms,
            "choice_vs_best_pct": 100.0 * (choice_ms - candidate_ms[best_candidate]) / candidate_ms[best_candidate],
            "auto_build_s": auto_build_s,
            "predicted_ms": {"baseline": auto.report.predicted_baseline_ms, "auto": auto.report.predicted_optimized_ms},
            "measured_ms": {k: m.median_ms for k, m in measured.items()},
            "spread_pct": {k: m.spread_pct for k, m in measured.items()}}


def markdown(rows: list[dict]) -> str:
    lines = ["| model | batch | mode | auto chose | best measured (passes that changed the graphs) "
             "| choice vs best | auto module vs best subset | measured ms per subset |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        per = ", ".join(f"{k} {v:.2f}" for k, v in r["measured_ms"].items())
        lines.append(f"| {r['model']}{' (tiny)' if r['tiny'] else ''} | {r['batch']} | "
                     f"{'training' if r['training'] else 'inference'} | {r['auto_chose']}"
                     f"{', ran eagerly' if r['auto_ran_eagerly'] else ''} | {r['best_candidate']} | "
                     f"{r['choice_vs_best_pct']:+.1f} % | {r['auto_vs_best_pct']:+.1f} % | {per} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(models.NAMES))
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--modes", default="inference", help="inference,training")
    parser.add_argument("--passes", default="fuse_conv_bias_act")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=3)
    parser.add_argument("--max-step-s", type=float, default=2.0)
    parser.add_argument("--out", default=None, help="file stem: writes .json and .md")
    args = parser.parse_args()
    passes = [p for p in args.passes.split(",") if p]
    rows = []
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            for mode in args.modes.split(","):
                rows.append(run_case(name, batch, mode == "training", passes, args.rounds, args.block, args.max_step_s))
                print(markdown(rows[-1:]).split("\n")[-1], flush=True)
    table = markdown(rows)
    print("\n" + table)
    if args.out:
        meta = {"device": platform.processor() or platform.machine(), "threads": torch.get_num_threads(),
                "torch": torch.__version__, "date": datetime.date.today().isoformat(), "measured": True}
        with open(args.out + ".json", "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
        with open(args.out + ".md", "w") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
