"""fxdream.simulate(): capture → (passes) → lower → simulate, for this machine or any DeviceSpec."""
from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch
import torch.fx.experimental._config as meta_config  # private; the only switch of the meta nonzero kernel
from torch.utils._pytree import tree_leaves

from fxdream.build import cost_model_for
from fxdream.capturing.arguments import check_memory_budget, check_model, inside_torch_compile
from fxdream.capturing.capture_model import capture_with_host_gaps
from fxdream.capturing.captured import CaptureError, captured_parts
from fxdream.capturing.keywords import bind_keywords
from fxdream.capturing.meta import check_meta_on_both_sides, meta_copy, mixed_dtype_call, on_meta
from fxdream.capturing.model_state import preserved_inputs, python_attributes_kept, rng_kept
from fxdream.ops.rnn_cell import cells_as_on
from fxdream.plan import plan
from fxdream.runtime.host_memory import settle_dynamic_thresholds
from fxdream.sim.cost import CostModel, DeviceSpec, Profiled
from fxdream.sim.optimizer_step import OPTIMIZERS, OptimizerModel
from fxdream.sim.prediction import Prediction, predict
from fxdream.sim.profile.machine_load import watch_machine_load
from fxdream.sim.profile.store import forget_profiles


def simulate(model: torch.nn.Module, example_inputs=(), device: str | DeviceSpec = "cpu",
             training: bool = False, cost: str = "auto", optimizer: str | None = "sgd",
             contention: bool = True, passes=(), memory_budget: int | None = None,
             example_kwargs: dict | None = None) -> Prediction:
    """Predict one iteration of ``model`` on ``device`` (a DeviceSpec name such as "h100"), called
    with ``example_inputs`` and the keyword inputs ``example_kwargs``.

    Training includes backward and the optimizer step (``optimizer``: "sgd" with momentum,
    "sgd_plain" (torch's default ``momentum=0``: no state), "adam", or None).
    ``passes`` ("auto" or names) rewrite the captured graphs for ``device`` first (nothing runs
    there: a GPU works from a CPU machine); the rows say what each did (``.passes``).
    """
    if optimizer is not None and optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not known; valid: {', '.join(OPTIMIZERS)} or None")
    check_model(model)
    model = inside_torch_compile(model)
    check_memory_budget(memory_budget)
    model, example_inputs = bind_keywords(model, example_inputs, example_kwargs)  # all positional from here
    captured_model, inputs, model_cost = prediction_inputs(model, example_inputs, device, cost)
    if isinstance(model_cost, Profiled) and model_cost.device.kind == "cpu":
        settle_dynamic_thresholds()  # timed in the allocator's state later calls run in
    # the model's Python attributes, the inputs and the RNG as they were (the prediction's steps call
    # forward, ops are timed on random data); where costs are measured here: did other processes run beside them?
    with python_attributes_kept(model), preserved_inputs(example_inputs), rng_kept(model), \
            watch_machine_load() as load:
        prediction = _simulate((model, example_inputs), captured_model, inputs, model_cost, device, training,
                               optimizer, contention, passes, memory_budget)
    if load.disturbed and isinstance(model_cost, Profiled):
        forget_profiles()  # costs measured beside other processes: not for later predictions to reuse
    extra = disturbed_notes(load, model_cost) + _precision_notes(model, example_inputs, model_cost.device)
    if training and not any(p.requires_grad for p in model.parameters()):
        extra += ("training=True, but no parameter of the model requires grad (frozen, or packed as a dynamically "
                  "quantized model's weights are): the step has no backward or optimizer step to predict",)
    return dataclasses.replace(prediction, notes=prediction.notes + extra) if extra else prediction


def _precision_notes(model: torch.nn.Module, inputs: tuple, device: DeviceSpec) -> tuple[str, ...]:
    """What the prediction does not do about precision: an autocast the call is made inside (the
    capture's graphs compute in the model's dtypes; autocast inside forward is captured), and
    bfloat16 on a device without a bfloat16 rate (costed at float32's, as the GPU has no bf16 math)."""
    notes = []
    outer = [kind for kind in ("cpu", "cuda") if torch.is_autocast_enabled(kind)]
    if outer:
        notes.append(f"called inside torch.autocast({outer[0]!r}): the prediction does not apply it (the captured "
                     f"graphs compute in the model's dtypes); put torch.autocast inside forward, or predict it "
                     f"with whatif.amp")
    tensors = [*model.parameters(), *model.buffers(), *(x for x in inputs if isinstance(x, torch.Tensor))]
    if device.kind == "cuda" and "bfloat16" not in device.peak_flops and \
            any(t.dtype == torch.bfloat16 for t in tensors):
        notes.append(f"{device.name} has no bfloat16 math: bfloat16 kernels are costed at its float32 rate")
    return tuple(notes)


def disturbed_notes(load, cost) -> tuple[str, ...]:
    """A note where costs measured here (``cost``: ``Profiled``; or an analytic CPU's calibration)
    were measured while other processes kept the cores busy (``load``: a ``watch_machine_load``
    of the measuring)."""
    if isinstance(cost, Profiled):  # measured op by op: no calibration read
        return (f"measurements disturbed: {load.describe('prediction')}; its measured costs describe a busy "
                f"machine",) if load.disturbed else ()
    device = getattr(cost, "device", None)
    if device is not None and device.kind == "cpu" and device.calibration_disturbed:
        return (f"this CPU's calibration (peak FLOP/s, bandwidth) disturbed: {device.calibration_disturbed}, "
                f"each of its tries; its analytic costs describe a busy machine",)
    return ()


def _simulate(original: tuple, model: torch.nn.Module, example_inputs: tuple, model_cost, device, training: bool,
              optimizer: str | None, contention: bool, passes, memory_budget: int | None) -> Prediction:
    """``simulate`` of ``model`` on ``example_inputs`` (``original``'s, or their meta copy) with
    ``model_cost``; a meta copy that cannot be captured (it reads tensor values, or makes tensors
    on a fixed device) is captured on ``original``'s data."""
    model, captured, step, notes = capture_for_prediction(original, model, example_inputs, training, model_cost)
    optimizer_model = OPTIMIZERS.get(optimizer)
    outside = tensors_outside_graphs(model, captured, step.input_storages if step is not None else ())
    outside_static, outside_gradient_bytes = _state_of(outside, training, optimizer_model)
    learned = [t for t in outside if training and t.requires_grad]  # eager code's parameters: updated too
    if optimizer_model is not None and learned:
        optimizer_model = dataclasses.replace(optimizer_model, outside_gradients=tuple(
            (t.untyped_storage().nbytes(), t.numel()) for t in learned))
    if outside_static + outside_gradient_bytes >= 2**20:
        notes += (f"{(outside_static + outside_gradient_bytes) / 2**20:.1f} MiB of the model's parameters and buffers"
                  f"{' (with their gradients and optimizer state)' if training else ''} are inputs of no captured "
                  f"graph (eager code between the graphs uses them, or nothing does): counted in the peak, while "
                  f"the activations of eager code are not",)
    notes += _sparse_gradient_note(model, optimizer if training else None)
    if passes:
        planned = plan(model, captured, device, training, passes, model_cost, memory_budget, optimizer_model,
                       contention, step=step)
        prediction = dataclasses.replace(planned.after, passes=planned.rows)
    else:
        prediction = predict(captured, model_cost, training, optimizer_model, contention=contention, step=step)
    return dataclasses.replace(prediction, notes=notes, static_bytes=prediction.static_bytes + outside_static,
                               outside_state_bytes=outside_static + outside_gradient_bytes,
                               outside_gradients=_named(model, learned))


def _named(model: torch.nn.Module, parameters: list[torch.Tensor]) -> tuple[tuple[str, int], ...]:
    """(qualified name, bytes) of each of ``parameters`` (the model's), as ``named_parameters`` names it."""
    names = {id(p): name for name, p in model.named_parameters()}
    return tuple((names.get(id(p), ""), p.untyped_storage().nbytes()) for p in parameters)


def _sparse_gradient_note(model: torch.nn.Module, optimizer: str | None) -> tuple[str, ...]:
    """A note where an embedding makes sparse gradients (``sparse=True``) that ``optimizer``
    refuses (torch's SGD takes them, its Adam raises: ``SparseAdam`` is the one for them); the
    captured backward makes a dense gradient, and the prediction prices that."""
    sparse = [name for name, m in model.named_modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and m.sparse]
    if not sparse or optimizer not in ("adam",):
        return ()
    where = ", ".join(repr(name) for name in sparse[:3]) + (" ..." if len(sparse) > 3 else "")
    return (f"the embedding at {where} makes sparse gradients (sparse=True), which torch.optim.Adam refuses "
            f"(torch.optim.SparseAdam takes them): predicted with dense gradients and Adam's dense state",)


def capture_for_prediction(original: tuple, model: torch.nn.Module, example_inputs: tuple, training: bool,
                           cost: CostModel | None = None) -> tuple:
    """Capture ``model`` on ``example_inputs`` for a prediction with ``cost`` (None: for a GPU,
    nothing measured): (the model captured, captured, StepCalls or None, notes). ``model`` is
    ``original``'s (model, inputs) or their meta copy. With measured costs (``Profiled``, this
    machine, real inputs) the host time outside the graphs is measured too. On the meta device a
    trained RNN cell is traced as ``cost``'s device runs it (``rnn_cell.cells_as_on``)."""
    with cells_as_on(cost.device.kind if cost is not None else "cuda"):
        return _capture_for_prediction(original, model, example_inputs, training, isinstance(cost, Profiled))


def _capture_for_prediction(original: tuple, model: torch.nn.Module, example_inputs: tuple, training: bool,
                            measure: bool) -> tuple:
    """``capture_for_prediction``; ``measure``: host time outside the graphs is measured.
    A meta copy of a model built with data that cannot be captured on the meta device (it reads
    tensor values, or makes tensors on a fixed device) is captured on ``original``'s data, with
    a note saying so. A model the user built on the meta device has no data to fall back on:
    boolean-mask indexing keeps every element there (``NONZERO_ASSUMED``), and a read of a value
    raises with what to do instead."""
    try:
        with _autocast_watch() as autocast_notes:
            captured, step, notes = capture_with_host_gaps(model, example_inputs, training, measure=measure)
    except Exception as error:
        return _captured_otherwise(original, model, example_inputs, training, measure, error)
    on_the_meta_device = on_meta(model, example_inputs)
    refused = mixed_dtype_call(part.forward for part in captured_parts(captured)) if on_the_meta_device else None
    if refused is not None:
        raise CaptureError(refused)
    return model, captured, step, tuple(autocast_notes) + tuple(notes)


def _captured_otherwise(original: tuple, model, example_inputs: tuple, training: bool, measure: bool, error) -> tuple:
    """``_capture_for_prediction`` where capturing ``model`` raised ``error``: on the meta device
    again with nonzero assumed, or on ``original``'s data, or the error with what to do."""
    if on_meta(*original) and NONZERO_ON_META in str(error) and not meta_config.meta_nonzero_assume_all_nonzero:
        with meta_config.patch(meta_nonzero_assume_all_nonzero=True):
            model, captured, step, notes = _capture_for_prediction(original, model, example_inputs, training,
                                                                   measure)
        return model, captured, step, (NONZERO_ASSUMED,) + notes
    hint = meta_hint(error) if on_meta(*original) else None
    if hint is not None:
        raise CaptureError(f"{error}\n{hint}") from error
    if measure or model is original[0] or on_meta(*original):
        raise error
    lengths_moved = all(t.is_meta for t in tree_leaves(example_inputs) if isinstance(t, torch.Tensor))
    if LENGTHS_ON_CPU in str(error) and lengths_moved:
        model, example_inputs, _ = meta_copy(*original, lengths_on_cpu=True)
        return _capture_for_prediction(original, model, example_inputs, training, measure)
    model, example_inputs = original
    captured, step, notes = capture_with_host_gaps(model, example_inputs, training, measure=False)
    reads_values = any(words in str(error) for words in META_VALUE_ERRORS)
    fallback = (f"captured on the example's data here, not on the meta device, where its capture failed "
                f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
                + ("; the forward reads tensor values, and the prediction follows the path (branches, sizes) "
                   "the example's values took: other inputs may take another" if reads_values else ""),)
    return model, captured, step, fallback + tuple(notes)


def state_outside_graphs(model: torch.nn.Module, captured, training: bool,
                         optimizer: OptimizerModel | None = None, called_with=()) -> tuple[int, int]:
    """(static bytes, gradient bytes) of the model's parameters and buffers no captured graph
    takes as an input (``tensors_outside_graphs``): code run eagerly between the graphs uses
    them (an RNN in training, code after a graph break), or nothing does, so no graph's memory
    holds them. Static: the tensors and, in training, ``optimizer``'s state for each parameter;
    gradient: in training, each parameter's gradient."""
    return _state_of(tensors_outside_graphs(model, captured, called_with), training, optimizer)


def _state_of(tensors: list[torch.Tensor], training: bool, optimizer: OptimizerModel | None) -> tuple[int, int]:
    """(static bytes, gradient bytes) of ``tensors`` (``state_outside_graphs``)."""
    state_copies = optimizer.state_copies if training and optimizer is not None else 0
    static = gradients = 0
    for tensor in tensors:
        learned = training and tensor.requires_grad
        nbytes = tensor.untyped_storage().nbytes()
        static += nbytes * (1 + (state_copies if learned else 0))
        gradients += nbytes if learned else 0
    return static, gradients


def tensors_outside_graphs(model: torch.nn.Module, captured, called_with=()) -> list[torch.Tensor]:
    """The model's parameters and buffers no captured graph takes as an input, one per storage.
    Tensors are told apart by their storage (a graph's input is a detached view of the
    parameter; on the meta device every data pointer is 0). ``called_with``: the storages a
    step's graph calls took (``StepCalls.input_storages``): a graph called once per layer holds
    each layer's parameters on its own call, which the lowering counts."""
    parts = captured_parts(captured)
    # a storage's _cdata (its C++ object's address; private, isolated): equal for views of one storage
    seen = {x.untyped_storage()._cdata for part in parts for position, x in enumerate(part.example_inputs)
            if position in part.state_positions and isinstance(x, torch.Tensor)} | set(called_with)
    outside = []
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            outside.append(tensor)
    return outside


# torch's pack_padded_sequence takes its lengths on the CPU on any device: a meta copy that moved
# them to the meta device is made again with them left there (``meta_copy(lengths_on_cpu=True)``)
LENGTHS_ON_CPU = "'lengths' argument should be a 1D CPU int64 tensor"


# A model the user built on the meta device has no data to count a mask's true elements in
# (boolean-mask indexing, nonzero): torch's meta kernel can take every element as kept instead.
NONZERO_ON_META = "register_meta function for torch.nonzero()"
NONZERO_ASSUMED = ("nonzero (boolean-mask indexing) on the meta device keeps every element here: the sizes it "
                   "makes, and the work after it, are upper bounds")


# A model on the meta device whose forward makes a tensor in code dynamo runs as Python (not
# traced) hands the trace a meta constant it cannot use; Hugging Face's KV cache is the usual one.
META_CONSTANT_HINT = ("hint: the model made a tensor on the meta device outside the traced code, which a "
                      "capture with fake tensors cannot use; for a Hugging Face model pass use_cache=False in "
                      "example_kwargs, or build the model on the CPU (simulate copies it to the meta device "
                      "itself)")


# A model on the meta device that reads a tensor's value (``.item()``, ``if x.sum() > 0``,
# ``nonzero``, ``.tolist()``) has none to read: torch's meta kernels say so in these words.
META_VALUE_ERRORS = ("cannot be called on meta tensors", "meta tensor; no data", "register_meta function",
                     "cannot be converted to Scalar", "meta tensor without output_size")
META_VALUE_HINT = ("hint: the model reads a tensor's value (.item(), a branch on a tensor, nonzero, .tolist()), "
                   "which a model on the meta device does not have: build the model on the CPU with real "
                   "example inputs (simulate then captures on their data, nothing runs on the predicted device), "
                   "or make the forward not depend on values")


# An op torch has no meta kernel for (``masked_select``) cannot run on a model on the meta device.
META_KERNEL_MISSING = "no fake impl or Meta kernel registered"
META_KERNEL_HINT = ("hint: the model calls an op torch cannot run on the meta device (it has no meta kernel, "
                    "as ops whose output size follows values, masked_select or unique, have none): build the "
                    "model on the CPU with real "
                    "example inputs (simulate then captures on their data, nothing runs on the predicted device)")


def meta_hint(error: Exception) -> str | None:
    """What to do about a capture of a meta model that failed, where the error says why."""
    text = str(error)
    if "fake tensor" in text.lower():
        return META_CONSTANT_HINT
    if any(words in text for words in META_VALUE_ERRORS):
        return META_VALUE_HINT
    if META_KERNEL_MISSING in text:
        return META_KERNEL_HINT
    return None


@contextlib.contextmanager
def _autocast_watch():
    """Yields a list that gets a note when the model entered a ``torch.autocast`` region that
    torch disabled (autocast for a device this machine lacks, e.g. "cuda" here): the graphs
    then hold the ops without autocast's casts and in the input dtype, and so does the
    prediction. The warnings are passed on, each message and place once."""
    notes: list[str] = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield notes
    passed_on = set()
    for w in caught:  # once per message and place, as the default filter shows them
        where = (str(w.message), w.category, w.filename, w.lineno)
        if where not in passed_on:
            passed_on.add(where)
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    if any("Disabling autocast" in str(w.message) for w in caught):
        notes.append("the model enters torch.autocast for a device this machine does not have, which torch "
                     "disabled: predicted without autocast (its dtype casts and low-precision kernels)")


def prediction_inputs(model: torch.nn.Module, example_inputs, device: str | DeviceSpec, cost: str) -> tuple:
    """(model, positional inputs, cost model) to capture for a prediction: with analytic costs (a
    device that is not here, or ``cost="analytic"``) a copy on the meta device, so nothing runs
    on real data here; a model already on the meta device takes analytic costs."""
    inputs = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
    check_meta_on_both_sides(model, inputs)
    meta = on_meta(model, inputs)
    if meta and cost == "profiled":
        raise ValueError("cost='profiled' measures the model on this machine, and its tensors are on the meta "
                         "device (no data): use cost='analytic' (or 'auto') for a meta model")
    model_cost = cost_model_for(device, "analytic" if meta and cost == "auto" else cost, reuse=True)
    if isinstance(model_cost, Profiled) or meta:
        return model, example_inputs, model_cost
    model, inputs, _ = meta_copy(model, inputs)
    return model, inputs, model_cost
