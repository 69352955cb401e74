"""optimize(): capture → passes → executable module, as an explicit list of steps."""
from __future__ import annotations

import functools
import logging
import math
import time

import torch

from fxdream.capturing.arguments import (
    TORCHSCRIPT_MODEL,
    check_counts,
    check_flag,
    check_memory_budget,
    check_model,
    inside_torch_compile,
    resolve_device,
)
from fxdream.capturing.blockwise import capture_after_nothing
from fxdream.capturing.captured import CaptureError
from fxdream.capturing.dynamo import describe_error, dynamo_state_kept, graph_break_counts, new_graph_breaks
from fxdream.capturing.gc_freeze import older_objects_frozen
from fxdream.capturing.host_gaps import describe_gaps, measure_model_gaps, worth_measuring
from fxdream.capturing.keywords import WithKeywords, bind_keywords, call_values, user_model
from fxdream.capturing.model_state import (
    StateSamples,
    initialize_lazy_modules,
    moved_parameters_note,
    preserved_inputs,
    preserved_state,
    python_attributes_kept,
    python_objects_restorer,
    switch_to_build_mode,
)
from fxdream.capturing.session import CaptureSession
from fxdream.capturing.steps import breaks_after_the_first_call, run_once, seeded_step
from fxdream.capturing.torch_fx import compile_model
from fxdream.eager_check import check_against_eager
from fxdream.measure import time_interleaved
from fxdream.numerics import deviation, difference
from fxdream.optimized_module import OptimizedModule, call_kind
from fxdream.pass_api import PassContext
from fxdream.pass_registry import available_passes, resolve_passes
from fxdream.pass_rows import not_run
from fxdream.pass_runner import PassPipeline
from fxdream.runtime.host_memory import fresh_memory_note, settle_dynamic_thresholds, timed_fresh_memory_note
from fxdream.sim.cost import Analytic, CostModel, DeviceSpec, Profiled, get_device
from fxdream.sim.measured_scale import graph_scale, rescaled_ms
from fxdream.sim.prediction import predict, this_machine_device
from fxdream.sim.profile.machine_load import watch_machine_load
from fxdream.sim.profile.store import forget_profiles, save_profile, shared_profile

log = logging.getLogger("fxdream")  # INFO: a build's progress (each pass's row as it is decided)


def optimize(model: torch.nn.Module, example_inputs=(), passes=(), training: bool = False,
             device=None, strict: bool = False, cost: str | None = "auto",
             memory_budget: int | None = None, verify: bool = False, measure: bool = False,
             eager_check: bool | None = None, example_kwargs: dict | None = None,
             timing_rounds: int | None = None, precision: str = "fp32") -> OptimizedModule:
    """Capture ``model`` at ``example_inputs`` (forward's positional arguments) and
    ``example_kwargs`` (its keyword arguments, as torch.export takes them: Hugging Face models'
    ``input_ids=``, ``attention_mask=``, ``labels=``), apply ``passes``, and return a module equal
    to eager, called the same ways as the model.

    The module runs through the captured graphs (with ``training=False`` always under
    ``torch.no_grad()``: folded weights are constants); ``.report`` tells what was captured,
    where dynamo broke the graph, and what each pass did. When dynamo cannot trace the
    model it runs eagerly and the report says why; ``strict=True`` raises instead
    (also on graph breaks, where parts of the model would run eagerly). A model whose own
    train/eval flag is not ``training`` is switched to it, every submodule with it, and left so
    (the report says so); otherwise each submodule keeps its flag (BatchNorm frozen in eval
    while the rest trains, dropout left on for MC dropout).

    ``passes``: names or Pass objects, applied in order and forced; or "auto": every
    registered pass is considered, every subset simulated, and the best predicted one
    under ``memory_budget`` (bytes of predicted peak) applied. ``cost`` is the cost model
    passes are judged with: "auto" (measured on this machine), "profiled", "analytic",
    or None for no predictions. ``verify`` runs the module once against eager and
    reports the max error; ``measure`` times it against the passes-free capture.
    ``timing_rounds``: timed runs of each graph the build profiles in context (default: up to
    5 for a first look and up to 15 side by side, within budgets that keep a ResNet-50 bs1 build
    near 2 s); more give tighter medians and predictions for a longer build.

    ``precision``: "fp32" (default), or "bf16" for CPU inference with convolutions and matrix
    products in bfloat16 (the ``bf16`` pass, applied before ``passes``; never chosen by "auto" on
    its own, as it changes numerics): the report gives the measured deviation from float32 eager
    on the example inputs (``Report.precision_deviation``), or why bf16 was not applied.

    ``eager_check`` (default: with ``passes="auto"``, measured costs, not ``strict``) times the
    built module against eager when one eager call is short (≤ 20 ms: there the wrappers around
    the graphs can cost more than the passes save; no eager call where the graphs' measured ops
    predict more than twice that); measured more than 5 % slower, it runs
    eagerly and the report says so, with both times.
    """
    check_model(model)
    model = inside_torch_compile(model)
    model, inputs = bind_keywords(model, example_inputs, example_kwargs)
    training = check_flag("training", training)
    memory_budget = check_memory_budget(memory_budget)
    if timing_rounds is not None:
        check_counts(timing_rounds=timing_rounds)
    strict, verify, measure = (check_flag(n, v) for n, v in (("strict", strict), ("verify", verify),
                                                              ("measure", measure)))
    auto = isinstance(passes, str) and passes == "auto"
    eager_check = (auto and cost == "auto" and not strict) if eager_check is None \
        else check_flag("eager_check", eager_check)
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not known; valid: {', '.join(PRECISIONS)}")
    check_cost(cost)
    selected = resolve_passes(available_passes() if auto else passes)
    first = resolve_passes(PRECISIONS[precision])
    selected = first + tuple(p for p in selected if p not in first)
    initialize_lazy_modules(model, inputs)
    target = resolve_device(device, model, inputs)
    on_meta = target.type == "meta"
    if on_meta:  # no data: nothing to time, compare or pack
        selected, cost, verify, measure, eager_check = (), None, False, False, False
    if target.type == "cpu":
        settle_dynamic_thresholds()  # timed in the allocator's state the module will run in
    switched = switch_to_build_mode(model, training)  # kept: the module runs the model in this mode

    parameters = StateSamples.of(model, buffers=False)
    # the user's RNG, BN statistics, grads, Python attributes, inputs
    with preserved_state(model), python_attributes_kept(model), preserved_inputs(inputs), older_objects_frozen(), \
            dynamo_state_kept():
        started, name = time.perf_counter(), type(user_model(model)).__name__
        log.info("building %s (%s, %s, passes: %s) ...", name, "training" if training else "inference", target,
                 "auto" if auto else ", ".join(p.name for p in selected) or "none")
        module, disturbed = _measured_build(model, inputs, selected, auto, training, target, strict, cost,
                                            memory_budget, timing_rounds)
        build_seconds = time.perf_counter() - started
        if switched:
            module._note(f"{switched}; it stays in that mode", first=True)
        if on_meta:
            module._note(META_BUILD, first=True)
        if isinstance(model, WithKeywords):
            module._note(model.describe(), first=True)
        numeric_rows = _numeric_rows(module, selected)
        _check_built(module, model, inputs, training, target, verify, measure, eager_check, disturbed,
                     changed_numerics=any(r.applied for r in numeric_rows))
        _check_precision(module, model, inputs, numeric_rows, precision)
        log.info("built %s in %.1f s (%s)%s", name, time.perf_counter() - started, module._capture,
                 f"; runs eagerly: {module._fallback_reason}" if module._fallback_reason else "")
    moved = moved_parameters_note(parameters.changed())
    if moved:
        module._note(moved)
    if not module._extras.get("measurements_disturbed"):
        save_profile(module._cost_model)  # for a later process ($FXDREAM_PROFILE_DIR)
    module._finish(build_seconds, functools.partial(
        optimize, example_inputs=inputs, passes=passes, training=training, device=device, strict=strict, cost=cost,
        memory_budget=memory_budget, verify=verify, measure=measure, eager_check=eager_check,
        timing_rounds=timing_rounds, precision=precision))
    return module


# the passes each precision applies first, forced
PRECISIONS = {"fp32": (), "bf16": ("bf16",)}
COSTS = ("auto", "profiled", "analytic", None)
META_BUILD = ("the model is on the meta device (shapes, no data): captured without passes, timing or checks, which "
              "need values; fxdream.simulate(model, inputs, device=...) predicts it on any device")


def check_cost(cost) -> None:
    """One of ``COSTS``, checked with no passes too: a typo must not pass silently."""
    if cost not in COSTS:
        raise ValueError(f"cost={cost!r} is not a cost model; valid: {', '.join(map(repr, COSTS))}")


def _numeric_rows(module: OptimizedModule, selected) -> list:
    """The report's rows of the selected passes that change numerics (``changes_numerics``)."""
    changing = {p.name for p in selected if getattr(p, "changes_numerics", False)}
    return [r for r in module._pipeline.rows if r.name in changing]


def _check_precision(module: OptimizedModule, model, inputs: tuple, rows: list, precision: str) -> None:
    """A pass that changes numerics and applied (``rows``: its report rows): the outputs' measured
    deviation from float32 eager. Asked for by ``precision`` and not applied: the reason, in a note."""
    applied = sorted({r.name for r in rows if r.applied})
    if applied and module._fallback_reason is None:
        module._record(precision="+".join(applied),
                       precision_deviation=deviation(model, module.called_positionally(), inputs))
        slower = sum(r.predicted_delta_us for r in rows if r.applied and (r.predicted_delta_us or 0) > 0)
        if slower:
            module._note(f"{'+'.join(applied)} is predicted {slower / 1e3:.3f} ms slower per call than float32 "
                         f"here (its casts cost more than its faster kernels save on graphs this small)")
    elif precision != "fp32":
        why = module._fallback_reason or "; ".join(sorted({r.reason for r in rows})) or "no graph to rewrite"
        module._note(f"precision={precision!r} was not applied (the module computes in the model's own dtypes): "
                     f"{why}")


def _measured_build(model, inputs, selected, auto, training, target, strict, cost, memory_budget,
                    timing_rounds: int | None = None, tries: int = 2) -> tuple[OptimizedModule, bool]:
    """``_build`` and its whole-model prediction (with a cost model), watching the machine's load
    while they measure: (module, whether other processes disturbed the measurements). Disturbed,
    the report says so and marks the decisions; ``strict=True`` builds again, then raises."""
    for attempt in range(tries):
        with watch_machine_load() as load:
            module = _build(model, inputs, selected, auto, training, target, strict, cost, memory_budget,
                            timing_rounds)
            if module._fallback_reason is None and module._cost_model is not None:
                module._record(**_whole_model_prediction(module, model, inputs, training))
        measured = isinstance(module._cost_model, Profiled)
        if not (measured and load.disturbed):
            return module, False
        forget_profiles()  # costs measured beside other processes: not for a later build to reuse
        if not strict:
            module._mark_disturbed(load.describe())
            return module, True
        log.info("measurements disturbed (%s); building again", load.describe())
    raise CaptureError(f"strict=True: the build's measurements were disturbed {tries} times: {load.describe()}")


def _check_built(module: OptimizedModule, model, inputs: tuple, training: bool, target: torch.device,
                 verify: bool, measure: bool, eager_check: bool, disturbed: bool = False,
                 changed_numerics: bool = False) -> None:
    """What the build checks on the module it made: ``verify`` against eager, ``measure``
    against the capture without passes, and the eager check (which may send the module to run
    eagerly; on disturbed measurements it times eager itself instead of trusting the prediction).
    ``changed_numerics``: a pass that changes numerics (bf16) applied, so a verified difference
    beyond float32 rounding is its expected deviation, not a wrong result. Each check starts from
    the example's Python objects (a cache object the calls append to)."""
    if not (verify or measure or eager_check):
        return  # nothing calls the module: no objects to walk
    restore = python_objects_restorer(call_values(model, inputs))
    if verify:
        causes: list[str] = []
        found = difference(model, module.called_positionally(), inputs, training, causes=causes)
        diff = found.max_abs
        module._record(verified_max_abs_diff=diff)
        if beyond_rounding(found.max_scaled, model, inputs) and not changed_numerics:
            module._record(verified_beyond_rounding=True)
            for note in (causes or _why_outputs_differ(model, training)) if diff != math.inf else [
                    "an output's shape, or the number of outputs, differs from eager's: a pass changed what the "
                    "graph returns (run with passes=() to tell which)"]:
                module._note(note)
        restore()
    if measure:
        measured = _measure_against_capture(model, module, inputs, training, target, restore)
        module._record(**measured)
        note = fresh_memory_note(measured["measured_page_faults_per_call"])
        if note:
            module._note(note)
    if eager_check and module._fallback_reason is None:
        predicted = None if disturbed else module._extras.get("predicted_baseline_ms")
        module._record(**check_against_eager(model, module, inputs, training, restore, predicted))


# dynamo cannot trace DDP's forward (its logger, its hooks' bookkeeping); wrapped around the
# optimized module, DDP's gradient hooks fire on the same parameters the captured graphs update
DDP_OUTSIDE = ("the model is a DistributedDataParallel: it runs as it is; wrap DDP around the optimized module "
               "instead, DistributedDataParallel(fxdream.optimize(model, ...)), which keeps DDP's gradient hooks")


SCRIPT_MODULE = f"the model is {TORCHSCRIPT_MODEL}, and runs as it is; optimize the original nn.Module instead"


def _runs_as_it_is(model) -> str | None:
    """Why ``model`` is not captured at all (a wrapper or runtime no capture reaches), else None."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return DDP_OUTSIDE
    if isinstance(model, torch.jit.ScriptModule):
        return SCRIPT_MODULE
    return None


def _build(model, inputs, selected, auto, training, target, strict, cost, memory_budget,
           timing_rounds: int | None = None) -> OptimizedModule:
    """Capture (one throw-away step) with the pass pipeline as the graph transform."""
    as_it_is = _runs_as_it_is(model)
    if as_it_is is not None:
        if strict:
            raise CaptureError(f"strict=True: {as_it_is}")
        return OptimizedModule(model, model, CaptureSession(model), PassPipeline((), PassContext()), training,
                               target, strict, capture="none", fallback_reason=as_it_is)
    cost_model = cost_model_for(this_machine_device(target), cost, reuse=True, timing_rounds=timing_rounds) \
        if selected and cost else None
    if isinstance(cost_model, Profiled):
        cost_model.measure_overheads()  # before the capture: inside it they read several times higher
    pipeline = PassPipeline(selected, PassContext(device=target.type, training=training,
                                                  cost_model=cost_model, memory_budget=memory_budget), auto=auto)
    session = CaptureSession(model, transform=pipeline if selected else None)
    breaks_before = graph_break_counts()
    runner, how = compile_model(model, inputs, session, training)
    failure = None
    try:
        run_once(runner, model, inputs, training)
    except Exception as error:
        if strict:
            raise CaptureError(f"strict=True: capture of {type(user_model(model)).__name__} failed: "
                               f"{describe_error(error)}") from error
        if any(row.applied for row in pipeline.rows):  # the rewrites' fault, not the capture's
            without = _build(model, inputs, (), auto, training, target, strict, cost, memory_budget, timing_rounds)
            if without._fallback_reason is None:
                # none of the rewrites is kept (the graphs run as captured): each applied row says so
                why = f"the rewritten graphs failed when run ({describe_error(error)})"
                without._pipeline.rows[:] = [not_run(r, why) for r in pipeline.rows]
                return without
        run_once(model, model, inputs, training)  # if eager fails too, the model itself is broken
        failure = f"the model's capture ({how}) failed: {describe_error(error)}"
    graph_breaks, first_call_only = new_graph_breaks(breaks_before), ()
    if failure is None:
        graph_breaks, first_call_only = breaks_after_the_first_call(
            runner, model, inputs, training, lambda: session.clock.compilations, graph_breaks)
    if first_call_only:
        session.notes.append(f"the first call changed the model and met {len(first_call_only)} graph break(s) later "
                             f"calls do not (they recompiled): " + "; ".join(first_call_only))
    if failure is None and not session.captured():  # second and last chances
        retried = capture_after_nothing(model, inputs, session, training, graph_breaks)
        if retried is not None:
            runner, how, graph_breaks = retried
    module = OptimizedModule(model, runner, session, pipeline, training, target, strict, capture=how,
                             graph_breaks=graph_breaks, fallback_reason=failure)
    if session.records:  # the build's compilation counts
        module._count_compilation(call_kind(inputs, {}, training, training), session.records)
    if module._fallback_reason is None and not session.captured():
        module._fall_back("dynamo captured no graph"
                          + (": " + "; ".join(module._graph_breaks) if module._graph_breaks else ""))
    if strict and (module._fallback_reason or module._graph_breaks):
        raise CaptureError(f"strict=True: {type(user_model(model)).__name__} is not captured whole: "
                           + (module._fallback_reason or "graph breaks: " + "; ".join(module._graph_breaks)))
    return module


def beyond_rounding(diff: float, model, inputs) -> bool:
    """Whether a verified difference (``Difference.max_scaled``: at the outputs' own magnitude) is
    more than float32 kernels' rounding (1e-2), or half precision's (1e-1) where the model or its
    inputs are in half precision."""
    tensors = list(model.parameters()) + [x for x in inputs if isinstance(x, torch.Tensor)]
    half = any(t.dtype in (torch.float16, torch.bfloat16) for t in tensors)
    return not diff <= (1e-1 if half else 1e-2)


def _why_outputs_differ(model, training: bool) -> list[str]:
    """Known causes of a verified difference, where the model has them."""
    notes = []
    if not training and any(isinstance(m, torch.nn.TransformerEncoderLayer) for m in model.modules()):
        notes.append("nn.TransformerEncoderLayer in eval has an eager-only fast path (nested tensors for a "
                     "padding mask: padded positions come out as zeros); captured graphs, like torch.compile's, "
                     "take the standard path, where padded positions hold values")
    if any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in model.modules()) and training:
        notes.append("dropout draws its mask from the RNG: the graphs may draw it in another order than eager")
    return notes or ["the outputs differ from eager's by more than rounding; run with strict=True or "
                     "passes=() to find the cause, and please report it"]


# Calls of a built module of one inference graph on a CPU, timed for its prediction's scale
# (fxdream.sim.measured_scale): three, or one past 0.15 s (a VGG-19's at batch 1). No warm-up
# call: the capture ran the graph once, and the median of three outvotes a slower first call
# (a call past 0.15 s is the one sample, first or not, to keep the build short). None
# where a call compiles (a model dynamo recompiles on every call would otherwise compile
# during the build what only its eager check should see).
ONE_GRAPH_CALLS = dict(budget_s=0.15, compiling_steps=0, warmup=0)


def _whole_model_prediction(module: OptimizedModule, model, inputs, training: bool) -> dict:
    """Predicted iteration time with and without the passes, and where the time goes.

    With costs measured on this machine, a training step or a model with graph breaks also gets the host
    time outside its graphs (eager code between subgraphs, autograd), measured on a few steps; on a CPU
    the graphs' time is scaled to their calls in those steps (one inference graph: a few calls)."""
    cost = module._cost_model
    step, notes = None, ()
    breaks = len(module._graph_breaks)
    outside_graphs = worth_measuring(training, len(module.captured), breaks)
    if isinstance(cost, Profiled) and (outside_graphs or cost.device.kind == "cpu"):
        step = measure_model_gaps(module.called_positionally(), model, inputs, training, module._session.clock,
                                  named=breaks > 0 or len(module.captured) > 1,
                                  **({} if outside_graphs else ONE_GRAPH_CALLS))
        notes = describe_gaps(step, len(module.captured), training, breaks) if step is not None else ()
    before = predict(module.captured, cost, training, step=step)
    after = predict(module.captured, cost, training, graphs=module.rewritten_graphs, step=step)
    before_ms, before_range = before.time_ms, before.range_ms
    after_ms, after_range = after.time_ms, after.range_ms
    labels = {f"g{c.index}.{phase}" for c in module.captured for phase, _ in c.graphs()}
    scale = graph_scale(step, after, labels) if step is not None else None  # a step is measured with Profiled
    if scale is not None:
        (before_ms, before_range), (after_ms, after_range) = (rescaled_ms(before, scale, step),
                                                              rescaled_ms(after, scale, step))
        notes = tuple(notes) + (f"the graphs' times measured during the build are scaled by {scale:.2f}: the "
                                f"built module's graph calls took that share of them in its steps timed after it",)
    if isinstance(cost, Profiled):
        captured = [g for c in module.captured for g in (c.forward, c.backward) if g is not None]
        faults = timed_fresh_memory_note(cost.page_faults_per_run(captured),
                                         cost.page_faults_per_run(module.rewritten_graphs.values()))
        notes = tuple(notes) + ((faults,) if faults else ())
    return dict(predicted_baseline_ms=before_ms, predicted_optimized_ms=after_ms,
                predicted_baseline_ms_range=before_range, predicted_optimized_ms_range=after_range,
                predicted_peak_delta_bytes=after.peak_memory_bytes - before.peak_memory_bytes,
                top_layers=tuple((layer, us / 1e3) for layer, us in after.top_layers(10)), notes=notes)


def _measure_against_capture(model, module, inputs, training, target, restore) -> dict:
    """Time the optimized module against the same capture without passes, interleaved, each
    call after ``restore`` (the example's Python objects put back)."""
    baseline = _build(model, inputs, (), False, training, target, False, None, None)
    restore()
    with preserved_state(model):
        times = time_interleaved({"baseline": seeded_step(baseline.called_positionally(), inputs, training, restore),
                                  "optimized": seeded_step(module.called_positionally(), inputs, training, restore)},
                                 desc="measure")
    restore()
    return dict(measured_baseline_ms=times["baseline"].median_ms, measured_optimized_ms=times["optimized"].median_ms,
                measured_page_faults_per_call=times["optimized"].page_faults_per_call)


def built_by_fxdream(module: torch.nn.Module, example_inputs: tuple) -> torch.nn.Module:
    """``module`` built by ``optimize`` with no passes and no cost model, its progress lines
    silenced: a probe, not the user's build."""
    log = logging.getLogger("fxdream")
    disabled, log.disabled = log.disabled, True
    try:
        return optimize(module, example_inputs, cost=None)
    finally:
        log.disabled = disabled


def cost_model_for(device: str | DeviceSpec, cost: str = "auto", reuse: bool = False,
                   timing_rounds: int | None = None) -> CostModel:
    """``profiled`` measures on this machine (needs the device here); ``analytic`` works for any.

    ``reuse``: a profiled model shares the process's measurements (``sim.profile_store``), so
    a rebuild does not time again what an earlier build timed; without it, it starts empty.
    ``timing_rounds``: timed runs of each graph profiled in context (default: up to 5, and up to
    15 side by side, within budgets that keep a ResNet-50 bs1 build near 2 s; more: tighter
    medians, a longer build)."""
    spec = device if isinstance(device, DeviceSpec) else get_device(device)
    runnable_here = spec.kind == "cpu" or (torch.cuda.is_available() and _is_this_gpu(spec))
    if cost == "auto":
        cost = "profiled" if runnable_here else "analytic"
    if cost == "analytic":
        return Analytic(spec)
    if cost == "profiled":
        if not runnable_here:
            raise ValueError(f"cost='profiled' measures on this machine, which has no {spec.name}; "
                             "use cost='analytic' (valid: 'profiled', 'analytic', 'auto')")
        torch_device = "cuda" if spec.kind == "cuda" else "cpu"
        return (shared_profile(spec, torch_device, built_by_fxdream, timing_rounds) if reuse
                else Profiled(spec, torch_device, build_module=built_by_fxdream, context_rounds=timing_rounds))
    raise ValueError(f"cost={cost!r} is not a cost model; valid: 'profiled', 'analytic', 'auto'")


def _is_this_gpu(spec: DeviceSpec) -> bool:
    name = torch.cuda.get_device_name().lower()
    return spec.name.lower() in name
