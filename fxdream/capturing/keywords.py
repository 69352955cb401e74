"""Keyword arguments without a position of their own: keyword-only parameters and ``**kwargs``.

A capture takes the call as one positional tuple (``arguments.positional_call`` puts a keyword
at its parameter's position). Hugging Face models take flags through ``**kwargs``
(``output_hidden_states=True``, ``output_attentions=True``): such a keyword has no position.
When its value holds no tensor it is a constant of the call, as dynamo treats it (it guards on
it); when it holds tensors (``forward(x, *, mask)``) it is an input. ``WithKeywords`` is the
model with the constants bound and the tensor keywords taken after the positional arguments,
called positionally; a later call is run through the build when it passes the same constants
and the same tensor keywords (eagerly otherwise).

A forward behind a decorator (``functools.wraps``: transformers' ``check_model_inputs`` and its
kin) may add keywords of its own: transformers' fills ``use_cache`` from the config into the
keywords when its wrapper cannot see the parameter's position, so ``model(ids, None, ..., False)``
raises "got multiple values for argument 'use_cache'" where ``model(input_ids=ids,
use_cache=False)`` runs. Such a model keeps every keyword the user gave as a keyword
(``WithKeywords`` with ``by_name``): the capture and every eager call see the user's call.
"""
from __future__ import annotations

import inspect
from typing import Mapping

import torch

from fxdream.capturing.arguments import check_call, holds_tensors, keyword_split, positional_call


class WithKeywords(torch.nn.Module):
    """``model(*args, **constants)``. Its state dict is the model's own (same keys), so
    ``optimized.model.state_dict()`` saves what the model would."""

    def __init__(self, model: torch.nn.Module, constants: Mapping, tensor_keywords: tuple[str, ...] = (),
                 by_name: bool = False):
        super().__init__()
        self.model = model
        self.training = model.training  # the model's mode: a build compares its own flag with it
        self.constants = dict(constants)
        self.tensor_keywords = tuple(tensor_keywords)  # their values come last in a call's arguments
        self.by_name = by_name  # every keyword stays one, also those forward has a position for
        self.__dict__["_signature"] = inspect.signature(model.forward)

    def forward(self, *args):
        args, kwargs = self.as_called(args)
        return self.model(*args, **kwargs)

    def as_called(self, args: tuple) -> tuple[tuple, dict]:
        """The model's (args, kwargs) for this wrapper's positional ``args``: the last ones the
        tensor keywords, by name, with the bound flags."""
        split = len(args) - len(self.tensor_keywords)
        return args[:split], {**dict(zip(self.tensor_keywords, args[split:])), **self.constants}

    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def describe(self) -> str:
        """The report's line: the constants and tensor keywords, and what a call without them does."""
        given = ", ".join([f"{k}={v!r}" for k, v in self.constants.items()] +
                          [f"{k}=<tensor>" for k in self.tensor_keywords])
        why = (f"keywords as given: {type(self.model).__name__}.forward is a decorator's wrapper, which may add "
               f"keywords of its own" if self.by_name else
               f"keywords {type(self.model).__name__}.forward takes without a position")
        return (f"built for calls with {given} ({why}: flags bound as constants, tensors taken as inputs); a call "
                f"without them, or with other flags, runs eagerly")

    def place(self, args: tuple, kwargs: Mapping) -> tuple | None:
        """A call's arguments as the positional tuple ``forward`` takes, or None when its keywords
        without a position are not the constants (by value) and tensor keywords (by name) this
        was built with."""
        placed, unplaced = ({}, dict(kwargs)) if self.by_name else keyword_split(self._signature, kwargs)
        constants, tensor_keywords = _flags_and_tensors(unplaced)
        if constants != self.constants or set(tensor_keywords) != set(self.tensor_keywords):
            return None
        return positional_call(self.model.forward, args, placed, self._signature) + tuple(
            unplaced[name] for name in self.tensor_keywords)


def user_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model as the user gave it: inside ``WithKeywords`` where the build bound keywords."""
    return model.model if isinstance(model, WithKeywords) else model


def bind_keywords(model: torch.nn.Module, example_inputs, example_kwargs: Mapping | None) -> tuple:
    """(model, positional example inputs): keywords with a position put there, those without
    one (keyword-only, ``**kwargs``) bound by ``WithKeywords``: flags as constants, tensors as
    inputs after the positional ones."""
    inputs, unplaced = check_call(example_inputs, example_kwargs, model)
    by_name = bool(example_kwargs) and _decorated(model)
    if by_name:
        positional = (example_inputs,) if isinstance(example_inputs, torch.Tensor) else example_inputs
        inputs, unplaced = tuple(positional), dict(example_kwargs)  # checked above as one call
    if not unplaced:
        return model, inputs
    constants, tensor_keywords = _flags_and_tensors(unplaced)
    return (WithKeywords(model, constants, tensor_keywords, by_name),
            inputs + tuple(unplaced[k] for k in tensor_keywords))


def _decorated(model: torch.nn.Module) -> bool:
    """Whether the model's forward is a decorator's wrapper around its own (``functools.wraps``)."""
    return getattr(type(model).forward, "__wrapped__", None) is not None


def _flags_and_tensors(unplaced: Mapping) -> tuple[dict, tuple[str, ...]]:
    """(the keywords without a position that hold no tensor, by value: constants of the call;
    the names of those that do, in order: inputs)."""
    tensor_keywords = tuple(k for k, v in unplaced.items() if holds_tensors(v))
    return {k: v for k, v in unplaced.items() if k not in tensor_keywords}, tensor_keywords


def call_values(model: torch.nn.Module, inputs: tuple) -> tuple:
    """Everything a call of ``model`` on ``inputs`` reads: the inputs, and a ``WithKeywords``'
    constants (a cache object passed by keyword is one)."""
    return (inputs, model.constants) if isinstance(model, WithKeywords) else inputs
