"""The CLI's arguments: the model a command names (a zoo name, or the user's FILE.py:FUNCTION or
MODULE:FUNCTION) and the argparse types of its numbers."""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import sys

from fxdream import models
from fxdream.ab import user_build
from fxdream.models import NAMES
from fxdream.sim.cost import get_device


def build_model(name: str, batch: int, tiny: bool = False, training: bool = False):
    """(model, inputs, loss_fn) for a zoo name or a user model (``FILE.py:FUNCTION``), in the mode asked."""
    user = user_model(name, tiny=tiny)
    if user is not None:
        model, inputs, loss_fn = user(batch)
    else:
        model, inputs, loss_fn = models.build(name, batch, tiny=tiny)
    model.train(training)
    return model, inputs, loss_fn


def user_model(spec: str, device: str = "cpu", tiny: bool = False):
    """``FILE.py:FUNCTION`` or ``MODULE:FUNCTION`` → ``build(batch) -> (model, inputs, loss_fn)``
    on ``device``; None for a zoo name. FUNCTION(batch_size) returns (model, inputs) or (model,
    inputs, loss_fn); inputs a tensor, a tuple, or a dict of forward's keyword arguments; without a
    loss, training sums the outputs."""
    where, colon, name = spec.rpartition(":")
    if not colon:
        return None
    if not where or not name:
        raise ValueError(f"model {spec!r}: give FILE.py:FUNCTION or MODULE:FUNCTION")
    if tiny:
        raise ValueError(f"--tiny is for zoo models; {spec!r} builds what its function returns")
    if where.endswith(".py"):
        if not os.path.isfile(where):
            raise ValueError(f"model {spec!r}: no file {where!r}")
        loader = importlib.util.spec_from_file_location(f"fxdream_model_{abs(hash(where))}", where)
        module = importlib.util.module_from_spec(loader)
        sys.modules[loader.name] = module  # importable by name: inductor imports a model's module
        loader.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as error:
            raise ValueError(f"model {spec!r}: {error}") from error
    function = getattr(module, name, None)
    if not callable(function):
        raise ValueError(f"model {spec!r}: {where} has no function {name!r}")
    return user_build(function, device, label=f"model {spec!r}: {name}")


def file_safe(spec: str) -> str:
    """A model name or ``FILE.py:FUNCTION`` as part of a file name: ``mynet.py:build`` → ``mynet_build``."""
    return re.sub(r"[^A-Za-z0-9_-]+", "_", spec.replace(".py:", ":")).strip("_") or "model"


def positive_int(text: str) -> int:
    """argparse type: an integer ≥ 1 (a batch size, rounds, a block of calls)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


def device_name(text: str) -> str:
    """argparse type: a device the simulator has a spec for (``h100``, ``cpu``...), checked before
    the model is built."""
    try:
        get_device(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return text


def batch_sizes(text: str) -> tuple[int, ...]:
    """argparse type: comma-separated batch sizes, each ≥ 1 (``1,8,32``)."""
    sizes = tuple(positive_int(part.strip()) for part in text.split(",") if part.strip())
    if not sizes:
        raise argparse.ArgumentTypeError("no batch size given (e.g. 1,8,32)")
    return sizes


def model_args(parser, batch: int = 1, training: bool = True) -> None:
    """The arguments every per-model command takes."""
    parser.add_argument("model", help=MODEL_HELP.format(", ".join(zoo_names())))
    parser.add_argument("--batch", type=positive_int, default=batch)
    parser.add_argument("--tiny", action="store_true", help="the tiny config of the zoo model (fast)")
    if training:
        parser.add_argument("--training", action="store_true")


ROUNDS_HELP = "timed rounds, rounded up to a multiple of the runners (each in every position alike)"
MODEL_HELP = ("a zoo model ({}), or your own: FILE.py:FUNCTION or MODULE:FUNCTION, where "
              "FUNCTION(batch_size) returns (model, inputs) or (model, inputs, loss_fn)")


def zoo_names() -> tuple[str, ...]:
    return NAMES
