"""Inference capture without dynamo, for models torch.fx can trace whole.

Dynamo spends seconds on a large model before aot_autograd starts; ``torch.fx.symbolic_trace``
takes a small fraction of that. A symbolic trace, though, is only right where the model's Python does not
branch on what a Proxy cannot know (``isinstance(x, Tensor)``, ``x is None``), and it guards
nothing, and Python side effects in forward run once, at trace time. So the trace is kept
only when its output on the example equals eager's and forward left the modules' Python
attributes as they were (anything else falls back to dynamo, with the reason), and the runner
checks every call against what it was built for (input shapes, strides, dtypes, devices, the
modules' train/eval flags, grad mode, autocast off, and where forward updates an input in place,
which inputs share memory): a call whose tensors differ in shape, strides or dtype only is
captured again from the same trace, any other through dynamo, both with the same session.

Inference only: training keeps dynamo (autograd mutations of BN buffers, graph breaks kept
for RNNs, see ``capture.tracing_config``).
"""
from __future__ import annotations

import contextlib
import inspect
import operator
import os
import reprlib
import traceback
from typing import Callable

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from fxdream.capturing.constants import copy_constant_outputs
from fxdream.capturing.dynamo import compile_with, graph_break_counts, new_graph_breaks
from fxdream.capturing.model_state import StateSamples, attributes_kept, preserved_state
from fxdream.capturing.session import CaptureSession
from fxdream.capturing.steps import run_once
from fxdream.capturing.trace_check import constant_updated_in_place, module_state, run_both, same, same_leaves
from fxdream.capturing.traced_runner import TracedRunner, autocast_enabled


def compile_model(model: torch.nn.Module, inputs: tuple, session: CaptureSession,
                  training: bool) -> tuple[Callable, str]:
    """(runner, how it was captured): in inference torch.fx's trace when the model traces whole,
    else (training, or the reason) dynamo, both compiling through ``session``. A model holding
    TorchScript objects (a dynamically quantized linear's packed weights) compiles without the
    fake-tensor dispatch cache: its key holds the object, which has no ``__eq__``, so a second
    capture of the model in one process failed there and took another path."""
    with _fake_tensor_cache_off() if _holds_script_objects(model) else contextlib.nullcontext():
        reason = "training"
        if not training:
            with torch.no_grad(), preserved_state(model):
                runner, reason = trace_and_compile(model, inputs, session)
            if runner is not None:
                return runner, "torch.fx symbolic_trace"
        return compile_with(model, session), f"dynamo ({reason})"


def _holds_script_objects(model: torch.nn.Module) -> bool:
    return any(isinstance(value, torch.ScriptObject) for m in model.modules() for value in vars(m).values())


def _fake_tensor_cache_off():
    return torch._dynamo.config.patch(fake_tensor_cache_enabled=False)


def trace_and_compile(model: torch.nn.Module, inputs: tuple,
                      session: CaptureSession) -> tuple[TracedRunner | None, str | None]:
    """(a runner compiled through ``session``, None), or (None, why dynamo must capture instead).

    Compiles (so the pass pipeline runs) only once the trace is known to match eager on
    ``inputs``; call under ``torch.no_grad()`` with the model in eval mode. A compilation that
    fails leaves ``session`` as it was; so does anything else that goes wrong on this path."""
    records = len(session.records)
    try:
        runner, reason = _trace_and_compile(model, inputs, session)
    except Exception as error:  # this path is an optimization: never the reason a model fails
        runner, reason = None, f"the torch.fx path failed ({_headline(error)})"
    if runner is None:
        del session.records[records:]
    return runner, reason


def _trace_and_compile(model, inputs, session) -> tuple[TracedRunner | None, str | None]:
    if model.training or torch.is_grad_enabled():
        return None, "training"
    if autocast_enabled():
        return None, "built under autocast (its graph would run with autocast's casts at every call)"
    hooked = _modules_with_call_hooks(model)
    if hooked:
        return None, (f"forward hooks on {', '.join(hooked[:3])}{' and more' if len(hooked) > 3 else ''} (a trace "
                      f"would run their Python, such as storing an activation, once at trace time)")
    samples = StateSamples.of(model)  # versions and values: through ``.data`` only the values change
    traced, out_spec, reason = _flat_trace(model, inputs)
    if traced is None:
        return None, reason
    updated = constant_updated_in_place(traced, model)
    if updated is not None:
        return None, (f"forward updates a tensor it makes in place ({updated}: a trace keeps one such tensor "
                      f"across calls)")
    before = module_state(model)
    try:
        with attributes_kept(model):  # a probe's: eager's state rebound on its samples stays out of the model
            runs = run_both(model, traced, inputs)
            rebinds_state = module_state(model) != before
    except Exception as error:
        return None, f"the torch.fx trace does not run ({_headline(error)})"
    if samples.changed():
        return None, "forward updates a parameter or buffer in place (a trace would do it only once)"
    if rebinds_state:
        return None, "forward changes the modules' Python attributes (a trace would do it only once)"
    values = runs.values
    actual = pytree.tree_unflatten(values, out_spec)
    # outputs the example's run split (their number may follow the batch): the trace is for its shapes only
    generic = all(isinstance(v, torch.Tensor) for v in values)
    if not generic:
        out_spec = _expand_outputs(traced, values, out_spec)
        if out_spec is None:
            return None, "an output that is not a tensor"
    if not same(runs.expected, actual):
        if not same_leaves(runs.expected, values):
            return None, "the torch.fx trace's output differs from eager on the example" + (
                " (its first and last samples)" if runs.on_samples else "")
        out_spec = pytree.tree_flatten(runs.expected)[1]  # only the containers differ: return eager's
    copy_constant_outputs(traced)  # a trace-made constant returned: fresh memory per call, as eager's
    try:
        compiled = session(traced, list(inputs), one_trace=True)
    except Exception as error:
        return None, f"aot_autograd failed on the torch.fx trace ({_headline(error)})"
    compile_for = (lambda args: session(traced, args, one_trace=True)) if generic else None
    return TracedRunner(model, compiled, out_spec, inputs, session, mutates_inputs=runs.mutates_inputs,
                        compile_for=compile_for), None


def _modules_with_call_hooks(model: torch.nn.Module) -> list[str]:
    """Names of the modules a call runs hooks around (forward and pre-forward, the module's own
    or global ones: then every module, "(every module)")."""
    from_global = torch.nn.modules.module
    if from_global._global_forward_hooks or from_global._global_forward_pre_hooks:
        return ["(every module)"]
    return [name or "(the model)" for name, m in model.named_modules()
            if m._forward_hooks or m._forward_pre_hooks]


def dynamo_over_trace(model: torch.nn.Module, inputs: tuple, session: CaptureSession,
                      training: bool) -> tuple[TracedRunner | None, str | None]:
    """(a runner: dynamo compiling the model's torch.fx trace, None), or (None, why not).

    For models dynamo captures nothing from: a graph break inside a loop or inside torch.nn's
    own code (``nn.Sequential`` around a BatchNorm with ``momentum=None``) makes dynamo skip
    the whole frame, while the trace's straight-line code lets it resume after the break.
    The trace (its leaf modules are the model's own, so training updates the same buffers)
    is kept only when one step of it gives eager's outputs and buffers and leaves the
    modules' Python attributes alone; other calls go through dynamo on the model."""
    if _modules_with_call_hooks(model):
        return None, "forward hooks (a trace would run their Python once, at trace time)"
    try:
        traced, out_spec, reason = _flat_trace(model, inputs)
        if traced is None:
            return None, reason
        if training:
            _rnns_called_eagerly(traced)
        before = module_state(model)
        runs = []
        for fn in (model, lambda *xs: pytree.tree_unflatten(list(traced(*xs)), out_spec)):
            with preserved_state(model), torch.no_grad():
                torch.manual_seed(0)
                out = fn(*inputs)
                runs.append((out, [b.detach().clone() for b in model.buffers()]))
        if module_state(model) != before:
            return None, "forward changes the modules' Python attributes (a trace would do it only once)"
        if not same(*(out for out, _ in runs)) or not same(*(buffers for _, buffers in runs)):
            return None, "the torch.fx trace's outputs or buffers differ from eager on the example"
    except Exception as error:  # this path is a second chance: never the reason a model fails
        return None, f"the torch.fx path failed ({_headline(error)})"
    compiled = compile_with(traced, session)  # dynamo: other shapes are its to compile
    return TracedRunner(model, compiled, out_spec, inputs, session, grad_enabled=training,
                        compile_for=lambda args: compiled), None


def _flat_trace(model: torch.nn.Module, inputs: tuple):
    """(the model's torch.fx trace returning a flat tuple, the spec that rebuilds its output,
    None), or (None, None, why it cannot be traced and checked against eager)."""
    if getattr(model.forward, "_torchdynamo_disable", False):
        return None, None, "forward is excluded from compilation (torch._dynamo.disable)"
    other = [(i, x) for i, x in enumerate(inputs) if not isinstance(x, torch.Tensor)]
    if other:  # the trace takes tensors only: a value would be fixed in it
        where, value = other[0]
        more = f" and {len(other) - 1} more" if len(other) > 1 else ""
        return None, None, f"a non-tensor example input ({_described_input(model, where, value)}{more})"
    if any(t.device.type not in ("cpu", "cuda") for t in list(model.parameters()) + list(inputs)):
        return None, None, "tensors on a device whose values cannot be compared with eager's (meta)"
    traced, reason = _trace(model, len(inputs))
    if traced is None:
        return None, None, reason
    unread = [n.target for n in traced.graph.nodes if n.op == "placeholder" and not n.users]
    if unread:  # eager may well read it: a trace's branch on it saw a Proxy
        return None, None, (f"the torch.fx trace never reads the input {unread[0]!r} (a branch on its type, such "
                            f"as isinstance(x, torch.Tensor), sees a Proxy while tracing)")
    out_spec = _flatten_outputs(traced)
    if out_spec is None:
        return None, None, "an output that is not a tensor"
    return traced, out_spec, None


def _described_input(model: torch.nn.Module, position: int, value) -> str:
    """``name=value, at position N`` for forward's positional parameter at ``position`` (the
    model's own forward where ``WithKeywords`` wraps it), with "(its default)" where the value is
    the default: a call by keyword fills the positions before its keywords with them."""
    try:
        signature = model.__dict__.get("_signature") or inspect.signature(model.forward)
    except (TypeError, ValueError):
        signature = None
    positional = [p for p in signature.parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)] if signature else []
    text = f"{reprlib.repr(value)}, at position {position}"
    if position >= len(positional):
        return text
    parameter = positional[position]
    default = " (its default)" if parameter.default is not parameter.empty and parameter.default is value else ""
    return f"{parameter.name}={text}{default}"


def _rnns_called_eagerly(gm: fx.GraphModule) -> None:
    """In training dynamo refuses an RNN module's attribute (and gives up on the whole function);
    called through a function it does not trace instead, the RNN is a graph break it resumes after."""
    for node in list(gm.graph.nodes):
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), torch.nn.RNNBase):
            with gm.graph.inserting_before(node):
                call = gm.graph.call_function(_eager_call(gm.get_submodule(node.target)), node.args, node.kwargs)
            node.replace_all_uses_with(call)
            gm.graph.erase_node(node)
    gm.recompile()


def _eager_call(module: torch.nn.Module) -> Callable:
    def rnn_called_eagerly(*args, **kwargs):
        return module(*args, **kwargs)
    return torch.compiler.disable(rnn_called_eagerly, reason=f"{type(module).__name__} in training runs "
                                  "eagerly (dynamo does not trace RNN modules in training)")


def capture_from_trace(model: torch.nn.Module, inputs: tuple, session: CaptureSession, training: bool,
                       breaks: list) -> tuple[TracedRunner, str, list] | None:
    """Dynamo captured nothing (``breaks``: why): (runner, how, graph breaks) capturing the
    model's torch.fx trace instead (``dynamo_over_trace``), or None where that captures nothing."""
    breaks_before, records = graph_break_counts(), len(session.records)
    runner, _ = dynamo_over_trace(model, inputs, session, training)
    if runner is None:
        return None
    try:
        run_once(runner, model, inputs, training)
    except Exception:  # a second chance only: the caller reports the first failure
        runner = None
    if runner is None or not session.captured():
        del session.records[records:]
        return None
    why = "; ".join(b.rstrip(".") for b in breaks) or "no graph"
    return (runner, f"dynamo over the torch.fx trace (dynamo on forward captured nothing: {why})",
            new_graph_breaks(breaks_before))


def _trace(model: torch.nn.Module, n_inputs: int) -> tuple[fx.GraphModule | None, str | None]:
    """symbolic_trace with the arguments the example leaves out fixed at their defaults."""
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):
        return None, "forward has no inspectable signature"
    if any(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD, p.KEYWORD_ONLY) for p in parameters):
        return None, "forward takes *args, **kwargs or keyword-only arguments"
    rest = parameters[n_inputs:]
    if any(p.default is p.empty for p in rest):
        return None, "fewer example inputs than forward requires"
    try:
        with attributes_kept(model):  # a forward that rebinds its state would keep a proxy
            gm = _symbolic_trace(model, {p.name: p.default for p in rest} or None)
    except Exception as error:
        return None, f"torch.fx cannot trace it ({_headline(error)}{_in_model_code(error)})"
    # a fixed argument stays a placeholder guarded by an assert (on ``arg == default`` for a
    # number): the runner guards calls instead
    for placeholder in [n for n in gm.graph.nodes if n.op == "placeholder"][n_inputs:]:
        for user in list(placeholder.users):
            if user.op == "call_function" and user.target is operator.eq and user.users \
                    and all(_is_assert(check) for check in user.users):
                for check in list(user.users):
                    gm.graph.erase_node(check)
                gm.graph.erase_node(user)
            elif _is_assert(user):
                gm.graph.erase_node(user)
        if placeholder.users:
            return None, f"the fixed argument {placeholder.target!r} is still read by the trace"
        gm.graph.erase_node(placeholder)
    gm.recompile()
    return gm, None


def _symbolic_trace(model: torch.nn.Module, concrete_args: dict | None) -> fx.GraphModule:
    """``fx.symbolic_trace`` with buffers read as proxies: by default torch.fx runs an op on a
    buffer that forward reads before any input (``x * self.scale.exp()``) at trace time and
    keeps its result as a constant, which a later change of the buffer (``load_state_dict``) would
    not reach."""
    tracer = fx.Tracer()
    tracer.proxy_buffer_attributes = True
    graph = tracer.trace(model, concrete_args)
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def _is_assert(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "__name__", "").startswith("_assert")


def _headline(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0][:160] if text else ''}"


def _in_model_code(error: BaseException) -> str:
    """Where the model's own code (not torch's, not fxdream's) raised ``error``: ", at file:line
    `source`", or "" where none of its frames is the model's. torch.fx's errors name what failed,
    not the line of the model that asked for it."""
    own = (os.path.dirname(torch.__file__), os.path.dirname(os.path.dirname(__file__)))
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(own)]
    if not frames:
        return ""
    frame = frames[-1]
    return f", at {os.path.basename(frame.filename)}:{frame.lineno}" + (f" `{frame.line}`" if frame.line else "")


def _flatten_outputs(gm: fx.GraphModule):
    """Make the graph return a flat tuple of tensors (aot's requirement); the spec rebuilds it."""
    output = gm.graph.output_node()
    leaves, spec = pytree.tree_flatten(_plain(output.args[0]))
    if not leaves or not all(isinstance(leaf, fx.Node) for leaf in leaves):
        return None
    output.args = (tuple(leaves),)
    for node in reversed(gm.graph.nodes):  # namedtuple constructors the output no longer needs
        if _is_namedtuple_class(node.target) and not node.users:
            gm.graph.erase_node(node)
    gm.recompile()
    return spec


def _expand_outputs(gm: fx.GraphModule, values: list, spec):
    """Output nodes whose value is a tuple or list (a leaf module returning one, as ``nn.LSTM``'s
    ``(output, (h, c))``; the trace cannot know until it runs) become one getitem node per
    tensor in it: aot wants tensors out. The spec that rebuilds the output, or None where a
    value holds something other than tensors."""
    output = gm.graph.output_node()
    leaves = []
    for node, value in zip(output.args[0], values):
        paths = pytree.tree_flatten_with_path(value)[0]
        if not all(isinstance(leaf, torch.Tensor) for _, leaf in paths) or \
                not all(isinstance(key, pytree.SequenceKey) for path, _ in paths for key in path):
            return None
        with gm.graph.inserting_before(output):
            for path, _ in paths:
                item = node
                for key in path:
                    item = gm.graph.call_function(operator.getitem, (item, key.idx))
                leaves.append(item)
    output.args = (tuple(leaves),)
    gm.recompile()
    return pytree.tree_flatten(pytree.tree_unflatten(values, spec))[1]


def _plain(value):
    """torch.fx keeps a graph's output in its own immutable dict/list types: the model's are plain."""
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if type(value) is tuple:
        return tuple(_plain(v) for v in value)
    if isinstance(value, fx.Node) and value.op == "call_function" and _is_namedtuple_class(value.target):
        # the trace records ``Output(logits, hidden)`` as a node: rebuild it from its fields
        return value.target(*(_plain(a) for a in value.args), **{k: _plain(v) for k, v in value.kwargs.items()})
    return value


def _is_namedtuple_class(target) -> bool:
    return isinstance(target, type) and issubclass(target, tuple) and hasattr(target, "_fields")
