"""Argument checks with one clear line each: what was wrong and what is valid."""
from __future__ import annotations

import inspect
from typing import Callable, Iterable, Mapping

import torch


def check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


# what a TorchScript model (``torch.jit.ScriptModule``) is to a capture: optimize runs it as it
# is, the predictions refuse it, each with this
TORCHSCRIPT_MODEL = ("a TorchScript module (torch.jit.script or torch.jit.trace): it runs in TorchScript's runtime, "
                     "which neither torch.fx nor dynamo captures")


def inside_torch_compile(model: torch.nn.Module) -> torch.nn.Module:
    """The module ``torch.compile`` wrapped, else ``model``: fxdream captures the model itself
    (its own graphs replace the compiled ones), so the wrapper's frames, skip marks and dynamo
    caches, which earlier calls of it fill, play no part in whether it is captured."""
    return model._orig_mod if isinstance(model, torch._dynamo.eval_frame.OptimizedModule) else model


def check_inputs(example_inputs, example_kwargs: Mapping | None = None,
                 model: torch.nn.Module | None = None) -> tuple:
    """The example call as one positional tuple (``check_call``'s first part)."""
    return check_call(example_inputs, example_kwargs, model)[0]


def check_call(example_inputs, example_kwargs: Mapping | None = None,
               model: torch.nn.Module | None = None) -> tuple[tuple, dict]:
    """(the example call as one positional tuple, at least one of its values a tensor; the
    keywords without a position). ``example_inputs``: a tensor, or a tuple/list of forward's
    positional arguments; ``example_kwargs``: forward's keyword arguments, as torch.export takes
    them, put in place by ``positional_call`` on ``model``'s forward. Keywords without a position
    (keyword-only, ``**kwargs``, ``keyword_split``) are returned apart:
    ``capturing.keywords.bind_keywords`` binds them to the model."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        hint = (": give keyword arguments as example_kwargs={...} (a dict inside the tuple reaches forward as one "
                "positional argument)") if isinstance(example_inputs, dict) else ""
        raise TypeError("example_inputs must be a torch.Tensor or a tuple/list of forward's positional "
                        f"arguments (tensors, numbers, strings, None, and lists/dicts of them), "
                        f"got {type(example_inputs).__name__}{hint}")
    if example_kwargs is not None and not isinstance(example_kwargs, Mapping):
        raise TypeError(f"example_kwargs must be a dict of forward's keyword arguments, got "
                        f"{type(example_kwargs).__name__}")
    inputs, unplaced = tuple(example_inputs), {}
    if example_kwargs:
        if model is None:
            raise TypeError("example_kwargs needs the model, whose forward's signature places them")
        placed, unplaced = keyword_split(_signature(model.forward), example_kwargs)
        inputs = positional_call(model.forward, inputs, placed)
    allowed = (torch.Tensor, bool, int, float, str, type(None))
    leaves = []
    for i, value in enumerate(inputs):
        for leaf in torch.utils._pytree.tree_leaves(value):  # an argument may be a list/dict of tensors
            if not isinstance(leaf, allowed):
                raise TypeError(f"example_inputs[{i}] holds a {type(leaf).__name__}; expected "
                                "torch.Tensors (or Python numbers, strings, bools, None), possibly "
                                "in tuples, lists or dicts")
            leaves.append(leaf)
    if not any(isinstance(v, torch.Tensor) for v in leaves) and not any(map(holds_tensors, unplaced.values())):
        raise TypeError("example_inputs holds no torch.Tensor; pass the model's tensor arguments")
    return inputs, unplaced


def _signature(forward: Callable) -> inspect.Signature:
    try:
        return inspect.signature(forward)
    except (TypeError, ValueError):
        raise TypeError("keyword inputs need an inspectable forward signature; pass them positionally") from None


def keyword_split(signature: inspect.Signature, kwargs: Mapping) -> tuple[dict, dict]:
    """(the keywords forward takes at a position, the keywords it takes without one: keyword-only
    parameters and ``**kwargs``). Raises TypeError for a keyword forward does not take at all.
    Those without a position reach the capture through ``fxdream.capturing.keywords``: a flag
    such as ``output_hidden_states=True`` as a constant of the call, a tensor as an input."""
    parameters = signature.parameters.values()
    positional = {p.name for p in parameters
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)}
    keyword_only = {p.name for p in parameters if p.kind is inspect.Parameter.KEYWORD_ONLY}
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)
    unknown = [k for k in kwargs if k not in positional and k not in keyword_only and not any_keyword]
    if unknown:
        raise TypeError(f"keyword input(s) {', '.join(map(repr, unknown))} are not parameters of forward "
                        f"({', '.join(signature.parameters) or 'none'})")
    unplaced = {k: v for k, v in kwargs.items() if k not in positional}
    return {k: v for k, v in kwargs.items() if k in positional}, unplaced


def holds_tensors(value) -> bool:
    """Whether ``value`` is a tensor or a container holding one."""
    return any(isinstance(leaf, torch.Tensor) for leaf in torch.utils._pytree.tree_leaves(value))


def positional_call(forward: Callable, args: tuple, kwargs: Mapping,
                    signature: inspect.Signature | None = None) -> tuple:
    """``forward(*args, **kwargs)`` as one positional call that means the same: each keyword at
    its parameter's position, the parameters between them at their defaults. Raises TypeError for
    a keyword that is not one of forward's positional parameters (keyword-only, or caught by
    ``**kwargs``), naming the ones that are, and for an argument given twice or missing.
    ``signature``: forward's, where the caller keeps it (a module called by keyword every call)."""
    if not kwargs:
        return tuple(args)
    signature = signature or _signature(forward)
    positional = [p for p in signature.parameters.values()
                  if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    names = [p.name for p in positional]
    unknown = [name for name in kwargs if name not in names]
    if unknown:
        raise TypeError(f"keyword input(s) {', '.join(map(repr, unknown))} are not positional parameters of "
                        f"forward ({', '.join(names) or 'none'}); keyword-only and **kwargs arguments have no "
                        f"position (fxdream.capturing.keywords binds those that hold no tensor)")
    bound = signature.bind_partial(*args, **kwargs).arguments  # TypeError: given twice
    values = []
    for parameter in positional[: max(names.index(name) for name in bound) + 1]:
        if parameter.name in bound:
            values.append(bound[parameter.name])
        elif parameter.default is not parameter.empty:
            values.append(parameter.default)
        else:
            raise TypeError(f"forward's argument {parameter.name!r} has no default and no example value")
    return tuple(values)


def available_devices() -> tuple[str, ...]:
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return tuple(devices)


def parse_device(device) -> torch.device:
    """``torch.device(device)``, or a ValueError naming the devices of this machine."""
    try:
        return torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device={device!r} is not a device; valid here: {', '.join(available_devices())}") from None


def resolve_device(device, model: torch.nn.Module, inputs: tuple) -> torch.device:
    """The device the optimized module runs on; it must be where the model and inputs are."""
    valid = available_devices()
    if device is None:
        first = next(iter(model.parameters()), None)
        resolved = first.device if first is not None else next(
            v.device for v in inputs if isinstance(v, torch.Tensor))
    else:
        resolved = parse_device(device)
        if resolved.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available on this machine; "
                             f"valid here: {', '.join(valid)}")
        if resolved.type not in ("cpu", "cuda"):
            raise ValueError(f"device={device!r} is not supported; valid here: {', '.join(valid)}")
    for name, tensor in _named_tensors(model, inputs):
        if not _same_device(tensor.device, resolved):
            raise ValueError(f"{name} is on {tensor.device} but the target device is {resolved}; "
                             f"move the model and inputs with .to({str(resolved)!r}) first")
    return resolved


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index is None or b.index is None or a.index == b.index)


def _named_tensors(model: torch.nn.Module, inputs: tuple) -> Iterable[tuple[str, torch.Tensor]]:
    for name, p in model.named_parameters():
        yield f"parameter {name!r}", p
        break  # one parameter is enough to tell where the model lives
    for i, value in enumerate(inputs):
        if isinstance(value, torch.Tensor):
            yield f"example_inputs[{i}]", value


def check_flag(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}")
    return value


def is_number(value) -> bool:
    """An int or a float, not a bool (``True`` passes ``isinstance(value, int)``) nor a string."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_memory_budget(value) -> int | None:
    """None, or a number of bytes ≥ 0 (``memory_budget``): else one clear line."""
    if value is not None and not (is_number(value) and value >= 0):
        raise ValueError(f"memory_budget must be None or a number of bytes ≥ 0 (e.g. 2 * 2**30), got {value!r}")
    return value


def check_counts(**counts) -> None:
    """Each of ``counts`` an int ≥ 1, or a sequence of them (batch sizes): else one clear line."""
    for name, value in counts.items():
        several = isinstance(value, (list, tuple))
        values = value if several else (value,)
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
            raise ValueError(f"{name} must be {'integers' if several else 'an integer'} ≥ 1, got {value!r}")
