"""python -m fxdream demo | capture | simulate | ab | explain | whatif: see `python -m fxdream <command> --help`."""
from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
import json
import logging
import os
import sys
import time

import torch

import fxdream
from fxdream import whatif
from fxdream.ab import ab, check_device_here, plot_ab
from fxdream.capturing.captured import captured_parts
from fxdream.cli_arguments import (
    MODEL_HELP,
    ROUNDS_HELP,
    batch_sizes,
    build_model,
    device_name,
    file_safe,
    model_args,
    positive_int,
    user_model,
    zoo_names,
)
from fxdream.explain import crossover
from fxdream.measure import time_interleaved
from fxdream.plan import plan
from fxdream.sim.optimizer_step import OPTIMIZERS
from fxdream.sim.prediction import predict
from fxdream.sim.profile.machine_load import watch_machine_load
from fxdream.sim.profile.store import PROFILE_DIR_ENV
from fxdream.sim.trace import plot_comparison, plot_timeline, write_chrome_trace
from fxdream.simulation import capture_for_prediction, disturbed_notes, prediction_inputs, simulate


def cmd_capture(args) -> int:
    model, inputs, _ = build_model(args.model, args.batch, args.tiny, args.training)
    started = time.perf_counter()
    captured = fxdream.capture(model, inputs, training=args.training)
    seconds = time.perf_counter() - started
    for c in captured_parts(captured):
        print(c.summary(top=args.top))
    print(f"\ncaptured in {seconds:.2f} s")
    return 0


def cmd_demo(args) -> int:
    """The product in one run: optimize(passes="auto") on ResNet-50, its report, then eager vs
    the capture without passes vs the optimized module measured side by side."""
    model, inputs, _ = build_model(args.model, args.batch, args.tiny, training=False)
    model.eval()
    print(f"fxdream demo: {args.model} batch {args.batch}, inference on this CPU (torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads)\n")
    started = time.perf_counter()
    optimized = fxdream.optimize(model, inputs, passes="auto", verify=True)
    print(f"optimize(passes='auto') built in {time.perf_counter() - started:.1f} s "
          "(capture, in-context profiling, every subset of passes simulated)\n")
    print(optimized.report.to_markdown() + "\n")
    started = time.perf_counter()
    fxdream.optimize(model, inputs, passes="auto")  # as after a weight update
    print(f"rebuilt in {time.perf_counter() - started:.1f} s: a rebuild (after a weight update, say) reuses the "
          f"costs the first build measured (and a later process too, with {PROFILE_DIR_ENV} set)\n")
    baseline = fxdream.optimize(model, inputs)  # the capture without passes: what the passes start from
    with torch.no_grad():
        diff = (model(*inputs) - optimized(*inputs)).abs().max().item()
        results = time_interleaved({"eager": lambda: model(*inputs), "fxdream, no passes": lambda: baseline(*inputs),
                                    "fxdream, auto": lambda: optimized(*inputs)},
                                   rounds=args.rounds, block=args.block, desc="eager vs fxdream")
    base = results["eager"].median_ms
    print("| runner | median ms/call | spread | vs eager |\n|---|---|---|---|")
    for name, m in results.items():
        print(f"| {name} | {m.median_ms:.2f} | ±{m.spread_pct / 2:.1f} % | {base / m.median_ms:.2f}x |")
    print(f"\n(measured: median of {results['eager'].rounds} rounds x {args.block} calls, interleaved; "
          f"max abs diff of the outputs vs eager: {diff:.1e})")
    print(_gain_against_prediction(results, optimized.report))
    print(f"\nnext: python -m fxdream explain {args.model} --batch {args.batch} --device h100   "
          "(what each pass would do on a GPU, predicted)")
    return 0


def _gain_against_prediction(results: dict, report) -> str:
    """The measured gain of the passes (auto over the capture without them) beside the build's
    predicted gain and range."""
    measured = results["fxdream, no passes"].median_ms / results["fxdream, auto"].median_ms
    predicted = report.predicted_speedup_range
    if predicted is None:
        return f"measured gain of the passes: {measured:.2f}x (the build made no prediction)"
    inside = "inside" if predicted[0] <= measured <= predicted[1] else "outside"
    return (f"measured gain of the passes: {measured:.2f}x, {inside} the build's predicted "
            f"{report.predicted_speedup:.2f}x ({predicted[0]:.2f}–{predicted[1]:.2f})")


def cmd_simulate(args) -> int:
    """Predict one iteration of a zoo model on a device; write a Perfetto trace and a PNG."""
    model, inputs, _ = build_model(args.model, args.batch, args.tiny, args.training)
    print(f"simulating {args.model} batch {args.batch} ({'training' if args.training else 'inference'}) "
          f"on {args.device} with {args.cost} costs ...", flush=True)
    passes = () if not args.passes else ("auto" if args.passes == "auto" else args.passes.split(","))
    prediction = simulate(model, inputs, device=args.device, training=args.training, cost=args.cost,
                          optimizer=args.optimizer if args.training and args.optimizer != "none" else None,
                          passes=passes)
    print(prediction.summary(top=args.top))
    if args.trace:
        write_chrome_trace(prediction.task_graph, prediction.timeline, args.trace)
        print(f"trace: {args.trace} (open in https://ui.perfetto.dev)")
    if args.plot:
        plot_timeline(prediction.task_graph, prediction.timeline, args.plot,
                      title=f"{args.model} bs{args.batch} on {args.device} (predicted)")
        print(f"plot: {args.plot}")
    return 0


def cmd_whatif(args) -> int:
    """One training step of a zoo model, then each what-if of the Daydream paper on it (predicted)."""

    model, inputs, _ = build_model(args.model, args.batch, args.tiny, True)
    print(f"what-ifs for {args.model} batch {args.batch} training on {args.device} ({args.cost} costs) ...", flush=True)
    to_capture, capture_inputs, cost = prediction_inputs(model, inputs, args.device, args.cost)  # analytic: on meta
    with watch_machine_load() as load:
        _, captured, step, notes = capture_for_prediction((model, inputs), to_capture, capture_inputs, True, cost)
        base = predict(captured, cost, True, OPTIMIZERS[args.optimizer], step=step)
    _print_notes((*notes, *disturbed_notes(load, cost)))
    on_gpu = base.device.kind == "cuda"
    single = lambda run: (run, 1)  # noqa: E731  (scenario, GPUs it runs on)
    scenarios = {"AMP float16": single(lambda: whatif.amp(base, dtype="float16", captured=captured)),
                 "AMP bfloat16": single(lambda: whatif.amp(base, dtype="bfloat16", captured=captured)),
                 f"fused {args.optimizer}": single(lambda: whatif.fused_optimizer(base, captured=captured)),
                 "2x faster GPU": single(lambda: whatif.faster_gpu(base, 2.0))}
    for gbps in (10, 20, 40):
        c = whatif.Cluster(2, 8 if on_gpu else 1, network_gbps=gbps)
        ranks = c.machines * c.gpus_per_machine
        scenarios[f"DDP {c.machines}x{c.gpus_per_machine} @ {gbps} Gbps"] = (
            lambda c=c: whatif.ddp(base, c, captured=captured), ranks)
        scenarios[f"P3 {c.machines}x{c.gpus_per_machine} @ {gbps} Gbps (steady period)"] = (
            lambda c=c: whatif.p3(base, c, captured=captured), ranks)
    print(f"baseline (predicted): {base.time_ms:.3f} ms per step, {1e3 * args.batch / base.time_ms:.0f} samples/s\n\n"
          "| scenario | predicted ms per step | predicted samples/s | vs baseline |\n|---|---|---|---|")
    rows = []
    for name, (run, ranks) in scenarios.items():
        try:
            result = run()
        except (ValueError, KeyError) as error:  # a scenario this device or model cannot express
            print(f"| {name} | n/a: {error} | | |")
            continue
        rate = 1e3 * args.batch * ranks / result.time_ms
        rows.append(dict(result.to_dict(), name=name, ranks=ranks, predicted_samples_per_s=rate))
        # against what the scenario compares with (one GPU's period for a steady-state period)
        print(f"| {name} | {result.time_ms:.3f} | {rate:.0f} | {rate / (1e3 * args.batch / result.baseline_ms):.2f}x |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"baseline_ms": base.time_ms, "device": base.device.name, "scenarios": rows}, f, indent=1)
    return 0


def _check_optimizer(args) -> None:
    """``--optimizer`` is a training step's: given for an inference prediction, it would be
    silently ignored. With ``--training`` and none given: sgd."""
    if getattr(args, "command", None) not in ("simulate", "explain"):
        return
    if args.optimizer is not None and not args.training:
        raise ValueError(f"--optimizer {args.optimizer}: an optimizer step is part of a training step; add --training")
    if args.optimizer is None:
        args.optimizer = "sgd"


def _check_output_paths(args) -> None:
    """Before any work: a file to write whose folder does not exist (found only at the end, it
    cost a whole simulation and gave a traceback)."""
    for option in ("trace", "plot", "json", "out"):
        path = getattr(args, option, None)
        folder = os.path.dirname(path) if path else ""
        if folder and not os.path.isdir(folder):
            raise ValueError(f"--{option} {path}: no folder {folder!r}")


def _load_plugins(paths) -> None:
    """Run user pass files (each registers its passes with @fxdream.register_pass)."""
    for path in paths or ():
        if not os.path.isfile(path):
            raise ValueError(f"--load {path!r}: no such file")
        spec = importlib.util.spec_from_file_location(f"fxdream_plugin_{abs(hash(path))}", path)
        if spec is None or spec.loader is None:
            raise ValueError(f"--load {path!r}: not a Python file")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


def cmd_ab(args) -> int:
    """Per-pass A/B: measured and predicted, side by side, one row per batch size."""
    _load_plugins(args.load)
    check_device_here(args.device)
    model = user_model(args.model, args.device, args.tiny) or args.model
    result = ab(model, args.passes, batch_sizes=args.batch, training=args.training, device=args.device,
                tiny=args.tiny, rounds=args.rounds, block=args.block)
    print(result.to_markdown())
    for row in result.rows:
        for reason in row.pass_reasons:
            print(f"  bs{row.batch} {reason}")
    if args.json:
        with open(args.json, "w") as f:
            f.write(result.to_json())
        print(f"json: {args.json}")
    if args.plot:
        plot_ab(result, args.plot)
        print(f"plot: {args.plot}")
    return 0


def cmd_explain(args) -> int:
    """Where the time goes, what each pass would do and why, before/after trace and PNG."""
    _load_plugins(args.load)
    model, inputs, _ = build_model(args.model, args.batch, args.tiny, args.training)
    print(f"explaining {args.model} batch {args.batch} ({'training' if args.training else 'inference'}) "
          f"on {args.device} ...", flush=True)
    to_capture, capture_inputs, cost = prediction_inputs(model, inputs, args.device, "auto")  # elsewhere: on meta
    with watch_machine_load() as load:  # where costs are measured here: did other processes run beside them?
        model, captured, step, notes = capture_for_prediction((model, inputs), to_capture, capture_inputs,
                                                              args.training, cost)
        model.train(args.training)
        result = plan(model, captured, device=args.device, training=args.training,
                      passes=args.passes.split(",") if args.passes != "auto" else "auto",
                      cost=cost, optimizer=OPTIMIZERS.get(args.optimizer) if args.training else None, step=step)
    _print_notes((*notes, *disturbed_notes(load, cost)))
    print(result.before.summary(top=args.top))
    print()
    print(result.summary())
    if args.passes == "aux_stream_backward" or "aux_stream_backward" in args.passes.split(","):
        _print_crossover(captured, args)
    stem = args.out or f"fxdream_{file_safe(args.model)}_bs{args.batch}_{args.device}"
    write_chrome_trace(result.after.task_graph, result.after.timeline, stem + ".trace.json")
    plot_comparison((result.before.task_graph, result.before.timeline),
                    (result.after.task_graph, result.after.timeline), stem + ".png",
                    labels=("without passes (predicted)", "with passes (predicted)"),
                    title=f"{args.model} bs{args.batch} on {args.device}")
    print(f"\ntrace: {stem}.trace.json (Perfetto), timeline: {stem}.png")
    return 0


def _print_notes(notes) -> None:
    """The capture's notes (what a prediction left out, where it captured), before its numbers."""
    for note in notes:
        print(f"note: {note}")


def _print_crossover(captured, args) -> None:
    expression, bound, text = crossover(captured, device=args.device)
    print(f"\naux_stream_backward crossover (predicted): {text}\n  gain(b) = {expression}")


def build_parser() -> argparse.ArgumentParser:
    """The command line: one subcommand each for measuring (demo, ab) and predicting (capture,
    simulate, whatif, explain)."""
    parser = argparse.ArgumentParser(prog="fxdream", description=__doc__)
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_measuring_commands(sub)
    _add_predicting_commands(sub)
    return parser


def _add_measuring_commands(sub) -> None:
    demo = sub.add_parser("demo",
                          help="optimize ResNet-50 with passes=\"auto\", show the report, time it against eager")
    demo.add_argument("--model", default="resnet50")
    demo.add_argument("--batch", type=positive_int, default=1)
    demo.add_argument("--tiny", action="store_true", help="use the tiny config (fast)")
    demo.add_argument("--rounds", type=positive_int, default=5, help=ROUNDS_HELP)
    demo.add_argument("--block", type=positive_int, default=10, help="calls per runner in each round")
    demo.set_defaults(run=cmd_demo)

    abp = sub.add_parser("ab", help="measure a pass against no pass, beside the prediction")
    abp.add_argument("model", help=MODEL_HELP.format(", ".join(zoo_names())))
    abp.add_argument("--pass", dest="passes", required=True,
                     help="pass name(s), comma-separated (each applied), or auto (the subset optimize keeps)")
    abp.add_argument("--batch", type=batch_sizes, default=(1,), help="comma-separated batch sizes, e.g. 1,8,32")
    abp.add_argument("--training", action="store_true")
    abp.add_argument("--device", default="cpu", help="cpu or cuda (runs there; predicts for it)")
    abp.add_argument("--tiny", action="store_true", help="a zoo model's tiny config (fast)")
    abp.add_argument("--rounds", type=positive_int, default=5, help=ROUNDS_HELP)
    abp.add_argument("--block", type=positive_int, default=10, help="calls per runner in each round")
    abp.add_argument("--json", help="write the rows as JSON here")
    abp.add_argument("--plot", help="write a PNG of measured vs predicted Δ here")
    abp.add_argument("--load", action="append", help="a Python file that registers passes (repeatable)")
    abp.set_defaults(run=cmd_ab)


def _add_predicting_commands(sub) -> None:
    cap = sub.add_parser("capture", help="capture a model and print its layer summary")
    model_args(cap)
    cap.add_argument("--top", type=positive_int, default=None)
    cap.set_defaults(run=cmd_capture)

    sim = sub.add_parser("simulate", help="predict an iteration of a model on a device")
    model_args(sim)
    sim.add_argument("--device", type=device_name, default="cpu", help="cpu (this machine), v100, a100, h100, h200")
    sim.add_argument("--cost", default="auto", choices=("auto", "profiled", "analytic"))
    sim.add_argument("--optimizer", choices=(*OPTIMIZERS, "none"),
                     help="with --training: sgd (with momentum, the default), sgd_plain (momentum=0), adam, or none")
    sim.add_argument("--trace", help="write a Chrome/Perfetto trace JSON here")
    sim.add_argument("--plot", help="write a PNG timeline here")
    sim.add_argument("--top", type=positive_int, default=10)
    sim.add_argument("--pass", dest="passes", default="", help='predict with these passes ("auto" or names)')
    sim.set_defaults(run=cmd_simulate)

    wif = sub.add_parser("whatif", help="Daydream what-ifs (AMP, fused optimizer, faster GPU, DDP, P3), predicted")
    model_args(wif, batch=32, training=False)
    wif.add_argument("--device", type=device_name, default="h100", help="v100, a100, h100, h200 or cpu")
    wif.add_argument("--cost", default="analytic", choices=("auto", "profiled", "analytic"))
    wif.add_argument("--optimizer", default="adam", choices=tuple(OPTIMIZERS))
    wif.add_argument("--json", help="write the scenarios as JSON here")
    wif.set_defaults(run=cmd_whatif)

    exp = sub.add_parser("explain", help="predicted breakdown and what each pass would do, before vs after")
    model_args(exp)
    exp.add_argument("--device", type=device_name, default="cpu", help="cpu (this machine), v100, a100, h100, h200")
    exp.add_argument("--pass", dest="passes", default="auto", help='"auto" or pass name(s), comma-separated')
    exp.add_argument("--optimizer", choices=(*OPTIMIZERS, "none"),
                     help="with --training: the optimizer step it includes (as simulate's; default sgd)")
    exp.add_argument("--out", help="file stem for the .trace.json and .png")
    exp.add_argument("--top", type=positive_int, default=10)
    exp.add_argument("--load", action="append", help="a Python file that registers passes (repeatable)")
    exp.set_defaults(run=cmd_explain)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        _check_output_paths(args)
        _check_optimizer(args)
        with _progress_on_stderr(not args.quiet):
            return args.run(args)
    except (ValueError, TypeError, RuntimeError) as error:  # one line, not a dynamo traceback
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"fxdream {args.command}: error: {type(error).__name__}: {first}", file=sys.stderr)
        return 2


@contextlib.contextmanager
def _progress_on_stderr(enabled: bool):
    """The "fxdream" logger's INFO lines (a build's start, each pass's decision, its end) on
    stderr while a command runs: a large model's build takes tens of seconds, silent otherwise."""
    log = logging.getLogger("fxdream")
    if not enabled or log.isEnabledFor(logging.INFO):  # the user's own logging config stands
        yield
        return
    handler, level = logging.StreamHandler(sys.stderr), log.level
    handler.setFormatter(logging.Formatter("fxdream: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


if __name__ == "__main__":
    sys.exit(main())
