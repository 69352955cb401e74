"""What a build leaves as it was: the model's state (grads, buffers, RNG), every submodule's
train/eval flag, and the example inputs; and the one change it keeps, the train/eval mode of
a model built for the other mode."""
from __future__ import annotations

import contextlib
import functools
import types
from dataclasses import dataclass
from typing import Callable

import torch
from torch.nn.modules.lazy import LazyModuleMixin

from fxdream.runtime.graph_guards import tensor_version


@contextlib.contextmanager
def preserved_inputs(inputs):
    """Input tensors a forward updates in place (``x.mul_(2)``) get their values back afterwards,
    and inputs that require grad their ``.grad``; Python objects among the inputs (a KV cache a
    forward appends to) get their attributes and containers' contents back: a build runs the model
    several times, and the user's example must not come out changed (nor differ between the runs
    that check a trace against eager)."""
    objects, held = python_objects(inputs)
    tensors = list({id(t): t for t in [*torch.utils._pytree.tree_leaves(inputs), *held]
                    if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)}.values())
    saved = [(t, tensor_version(t), t.detach().clone()) for t in tensors]
    grads = [(t, t.grad, None if t.grad is None else t.grad.clone()) for t in tensors if t.is_leaf and t.requires_grad]
    try:
        yield
    finally:
        _put_all_back(objects)
        with torch.no_grad():
            for tensor, version, copy in saved:
                if tensor_version(tensor) != version or (version is None and torch.is_inference_mode_enabled()):
                    tensor.copy_(copy)  # (an inference tensor can change only in inference mode: copied back)
            for tensor, grad, values in grads:
                if grad is not None and tensor.grad is grad:  # accumulated into in place: its values back
                    grad.copy_(values)
                else:
                    tensor.grad = grad


_NOT_STATE = (torch.Tensor, torch.nn.Module, type, types.ModuleType, types.FunctionType, types.BuiltinFunctionType,
              types.MethodType, functools.partial, str, bytes, int, float, complex, bool, type(None), torch.dtype,
              torch.device)
_MOST_OBJECTS = 10_000  # a bound on the walk: inputs are data, not object graphs


def python_objects(roots) -> tuple[list[tuple[object, object]], list[torch.Tensor]]:
    """(Python object or container, its attributes or contents) for everything reachable from
    ``roots`` (tuples, lists, dicts, sets, objects' attributes) that a forward could rebind or
    refill: a ``DynamicCache``'s layers rebind their keys and values on every call. With the
    tensors found on the way (a static cache's tensors, updated in place). Modules are walked by
    ``python_attributes_kept``; tensors' values are ``preserved_inputs``' business."""
    found, tensors, seen, stack = [], [], set(), [roots]
    while stack and len(seen) < _MOST_OBJECTS:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        if isinstance(value, _NOT_STATE) or id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, (list, dict, set)):
            found.append((value, _contents(value)))
            stack.extend(value.values() if isinstance(value, dict) else value)
        elif isinstance(value, tuple):
            stack.extend(value)
        elif isinstance(getattr(value, "__dict__", None), dict):
            found.append((value, dict(vars(value))))
            stack.extend(vars(value).values())
    return found, tensors


def python_objects_restorer(roots) -> Callable[[], None]:
    """A function that gives the Python objects ``roots`` reach (``python_objects``) their
    attributes and contents as they are now: called between repeated calls of a model that
    appends to a cache object, so that every call sees the example's."""
    objects, _ = python_objects(roots)
    return lambda: _put_all_back(objects)


def _put_all_back(objects: list[tuple[object, object]]) -> None:
    for value, contents in objects:
        if isinstance(value, (list, dict, set)):
            _put_back(value, contents)
        else:
            vars(value).clear()
            vars(value).update(contents)


def uninitialized_lazy_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of each lazy module (``nn.LazyLinear``) not yet called: no shapes yet."""
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, LazyModuleMixin) and m.has_uninitialized_params()]


def initialize_lazy_modules(model: torch.nn.Module, inputs: tuple) -> None:
    """Lazy modules (``nn.LazyLinear``, ``nn.LazyBatchNorm2d``) not yet called take their shapes
    from one call, as eager's first call would: neither a trace nor dynamo can read an
    uninitialized weight, nor can the build's own state keeping. The call runs in eval mode
    without grad (no statistics updated, no dropout drawn), the RNG and the inputs as they were."""
    if not uninitialized_lazy_modules(model):
        return
    rng = torch.random.get_rng_state()
    try:
        with preserved_modes(model), torch.no_grad(), preserved_inputs(inputs):
            model.eval()
            model(*inputs)
    finally:
        torch.random.set_rng_state(rng)


def switch_to_build_mode(model: torch.nn.Module, training: bool) -> str | None:
    """Put ``model`` in the mode of a ``training`` build; the reason, or None if it already was.

    Only where the model's own flag says otherwise (a model left in train mode for an inference
    build): then every submodule is switched, as ``model.train(training)``. Where it agrees, each
    submodule keeps its flag (BatchNorm frozen in eval while the rest fine-tunes, dropout left on
    in an eval model for MC dropout): switching them all would make those builds compute
    something else than the model does."""
    if model.training == training:
        return None
    model.train(training)
    return (f"{type(model).__name__} was in {'eval' if training else 'train'} mode: the "
            f"{'training' if training else 'inference'} build switched it and every submodule to "
            f"{'train' if training else 'eval'} mode (model.train({training}))")


@contextlib.contextmanager
def attributes_kept(model: torch.nn.Module):
    """Every module's attributes, parameters, buffers and submodules as they were, whatever runs
    inside: a symbolic trace runs forward on proxies, and a forward that rebinds its state
    (``self.state = h.detach()``, a buffer reassigned) would leave a proxy in the model.
    TorchScript modules are left out: their tables are TorchScript's (no Python forward rebinds
    them), and cannot be cleared from Python."""
    saved = [(m, dict(vars(m)), dict(m._parameters), dict(m._buffers), dict(m._modules)) for m in model.modules()
             if not isinstance(m, torch.jit.ScriptModule)]
    try:
        yield
    finally:
        for module, attributes, parameters, buffers, submodules in saved:
            for key in [k for k in vars(module) if k not in attributes]:
                del module.__dict__[key]
            module.__dict__.update(attributes)
            for table, entries in ((module._parameters, parameters), (module._buffers, buffers),
                                   (module._modules, submodules)):
                table.clear()
                table.update(entries)


_MODULE_INTERNALS = frozenset(vars(torch.nn.Module()))  # torch's own tables (hooks, parameters, flags)


@contextlib.contextmanager
def python_attributes_kept(model: torch.nn.Module):
    """Every module's own Python attributes as they were (a call counter, the step a schedule
    reads, a list a forward appends to, a tensor it keeps as ``self.last``): a build or a
    prediction calls forward many times, and the user's next call must see the model its
    previous one left. Attributes are rebound as ``attributes_kept`` does; lists, dicts and sets,
    and the Python objects they reach (a cache object a forward appends to, the keywords a
    ``WithKeywords`` holds as constants), get their contents and attributes back in place (one
    held elsewhere stays the same object). Tensor values are not copied: their in-place updates
    are the buffers' and parameters' business."""
    objects, _ = python_objects([value for module in model.modules() for key, value in vars(module).items()
                                 if key not in _MODULE_INTERNALS])
    with attributes_kept(model):
        try:
            yield
        finally:
            _put_all_back(objects)


def _contents(container):
    return dict(container) if isinstance(container, dict) else list(container)


def _put_back(container, contents) -> None:
    if isinstance(container, list):
        container[:] = contents
    else:
        container.clear()
        container.update(contents)


@contextlib.contextmanager
def preserved_modes(model: torch.nn.Module):
    """Every submodule's train/eval flag as it was, whatever runs inside."""
    modes = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


@contextlib.contextmanager
def preserved_state(model: torch.nn.Module):
    """Run a throw-away step: keep parameters' grads, buffers (BN stats) and the RNG unchanged."""
    grads = {p: (None if p.grad is None else p.grad.detach().clone()) for p in model.parameters()}
    buffers = [(b, tensor_version(b), b.detach().clone()) for b in model.buffers()]
    with rng_kept(model):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, version, saved in buffers:  # only those changed (an inference module
                    if _changed(buffer, version, saved):  # watches the versions of the others)
                        # a tensor made under inference_mode is written only inside it
                        with torch.inference_mode() if buffer.is_inference() else contextlib.nullcontext():
                            buffer.copy_(saved)
                        _version_put_back(buffer, version)
            for p, saved in grads.items():
                p.grad = saved
            _refresh_rnn_weights(model)


def _version_put_back(buffer: torch.Tensor, version: int | None) -> None:
    """``buffer``'s version counter set back to ``version`` once its values are back as they were
    then: a graph the user's forward recorded before the step saved the buffer at that version
    (BatchNorm saves its running statistics), and its backward checks it; the step's updates and
    this restore would otherwise fail it ("modified by an inplace operation")."""
    if version is None:
        return
    try:  # private, isolated
        torch._C._autograd._unsafe_set_version_counter((buffer,), (version,))
    except Exception:
        pass


def rng_kept(model: torch.nn.Module):
    """The CPU generator's state, and that of each GPU the model's parameters are on, as they were
    after the block: what runs inside (a throw-away step, ops timed on random data) draws from them."""
    devices = sorted({p.device.index for p in model.parameters()
                      if p.device.type == "cuda" and p.device.index is not None})
    return torch.random.fork_rng(devices=devices)


def _changed(buffer: torch.Tensor, version: int | None, saved: torch.Tensor) -> bool:
    """Whether ``buffer`` is not ``saved`` any more: BatchNorm's kernel updates its running
    statistics without bumping their version, so the values are compared too."""
    return version is None or tensor_version(buffer) != version or buffer.device.type == "meta" \
        or not torch.equal(buffer, saved)


def _refresh_rnn_weights(model: torch.nn.Module) -> None:
    """A capture runs ``nn.RNNBase.forward`` on stand-ins for the parameters (aot_autograd's fake
    ones), which the module keeps in ``_flat_weights`` until a later forward notices and refreshes
    them: refresh them now. Left stale, the model would hold fake tensors, and its next forward
    would change its Python attributes, so a second optimize() of a GRU model would lose the
    torch.fx path."""
    for m in model.modules():
        if isinstance(m, torch.nn.RNNBase) and hasattr(m, "_weights_have_changed") \
                and m._weights_have_changed():  # private torch API, guarded
            m._update_flat_weights()


_SAMPLED_VALUES = 32  # values read from each tensor: a forward's in-place update changes more than one


@dataclass(frozen=True)
class StateSamples:
    """The version counters of a model's parameters (and buffers) and a few values of each,
    evenly spread: whether a forward updated one in place, also through ``.data`` (which has a
    version counter of its own, as MoCo's momentum encoder is written). A copy of every tensor
    would say it for every element, at the price of the model's size in memory and time."""
    names: tuple[str, ...]
    tensors: tuple
    versions: tuple
    values: tuple

    @classmethod
    def of(cls, model: torch.nn.Module, buffers: bool = True) -> "StateSamples":
        named = list(model.named_parameters()) + (list(model.named_buffers()) if buffers else [])
        tensors = tuple(t for _, t in named)
        return cls(tuple(name for name, _ in named), tensors, tuple(tensor_version(t) for t in tensors),
                   tuple(_sampled(t) for t in tensors))

    def changed(self) -> list[str]:
        """Names of the tensors whose version or sampled values differ from when these were taken."""
        return [name for name, tensor, version, values in zip(self.names, self.tensors, self.versions, self.values)
                if tensor_version(tensor) != version or not _same_bits(values, _sampled(tensor))]


def moved_parameters_note(names: list[str]) -> str | None:
    """What the report says of parameters the model's forward updated in place during a build (a
    momentum encoder, an EMA kept in a parameter, ``nn.Embedding(max_norm=...)``'s renorm): the
    build's own calls updated them too. They are not put back, as buffers are: that would hold a
    copy of every parameter through every build."""
    if not names:
        return None
    shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    return (f"forward updates parameters in place ({shown}): the build's own calls of the model updated them "
            f"as well; keep a copy (copy.deepcopy(model.state_dict())) before the build where their values "
            f"before it matter")


def _sampled(tensor: torch.Tensor) -> torch.Tensor | None:
    """A copy of up to ``_SAMPLED_VALUES`` of ``tensor``'s values, evenly spread; None where
    there are none to read (the meta device) or not cheaply (a non-contiguous tensor)."""
    if tensor.device.type == "meta" or not tensor.is_contiguous() or tensor.numel() == 0:
        return None
    with torch.no_grad():
        flat = tensor.detach().view(-1)
        return flat[::max(1, flat.numel() // _SAMPLED_VALUES)].clone()


def _same_bits(before: torch.Tensor | None, after: torch.Tensor | None) -> bool:
    """Bit for bit (NaN equals NaN); two tensors not read count as the same."""
    if before is None or after is None:
        return before is None and after is None
    return before.shape == after.shape and torch.equal(before.view(torch.uint8), after.view(torch.uint8))
