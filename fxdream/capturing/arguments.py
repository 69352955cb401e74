"""Argument checks with one clear line each: what was wrong and what is valid."""
from __future__ import annotations

from typing import Iterable

import torch


def check_model(model) -> None:
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")


def check_inputs(example_inputs) -> tuple:
    """A tensor or a tuple/list of example positional arguments, at least one of them a tensor."""
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if not isinstance(example_inputs, (tuple, list)):
        hint = (": keyword arguments are not taken; give forward's arguments positionally, in order "
                "(a dict inside the tuple reaches forward as one argument)") if isinstance(example_inputs, dict) else ""
        raise TypeError("example_inputs must be a torch.Tensor or a tuple/list of forward's positional "
                        f"arguments (tensors, numbers, strings, None, and lists/dicts of them), "
                        f"got {type(example_inputs).__name__}{hint}")
    inputs = tuple(example_inputs)
    allowed = (torch.Tensor, bool, int, float, str, type(None))
    leaves = []
    for i, value in enumerate(inputs):
        for leaf in torch.utils._pytree.tree_leaves(value):  # an argument may be a list/dict of tensors
            if not isinstance(leaf, allowed):
                raise TypeError(f"example_inputs[{i}] holds a {type(leaf).__name__}; expected "
                                "torch.Tensors (or Python numbers, strings, bools, None), possibly "
                                "in tuples, lists or dicts")
            leaves.append(leaf)
    if not any(isinstance(v, torch.Tensor) for v in leaves):
        raise TypeError("example_inputs holds no torch.Tensor; pass the model's tensor arguments")
    return inputs


def available_devices() -> tuple[str, ...]:
    devices = ["cpu"]
    if torch.cuda.is_available():
        devices += ["cuda"] + [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    return tuple(devices)


def resolve_device(device, model: torch.nn.Module, inputs: tuple) -> torch.device:
    """The device the optimized module runs on; it must be where the model and inputs are."""
    valid = available_devices()
    if device is None:
        first = next(iter(model.parameters()), None)
        resolved = first.device if first is not None else next(
            v.device for v in inputs if isinstance(v, torch.Tensor))
    else:
        try:
            resolved = torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"device={device!r} is not a device; valid here: {', '.join(valid)}") from None
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


def check_memory_budget(value) -> int | None:
    """None, or a number of bytes ≥ 0 (``memory_budget``): else one clear line."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0):
        raise ValueError(f"memory_budget must be None or a number of bytes ≥ 0 (e.g. 2 * 2**30), got {value!r}")
    return value


def check_counts(**counts) -> None:
    """Each of ``counts`` an int ≥ 1, or a sequence of them (batch sizes): else one clear line."""
    for name, value in counts.items():
        several = isinstance(value, (list, tuple))
        values = value if several else (value,)
        if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
            raise ValueError(f"{name} must be {'integers' if several else 'an integer'} ≥ 1, got {value!r}")
