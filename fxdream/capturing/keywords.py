"""Keyword arguments without a position of their own: keyword-only parameters and ``**kwargs``.

A capture takes the call as one positional tuple (``arguments.positional_call`` puts a keyword
at its parameter's position). Hugging Face models take flags through ``**kwargs``
(``output_hidden_states=True``, ``output_attentions=True``): such a keyword has no position.
When its value holds no tensor it is a constant of the call, as dynamo treats it (it guards on
it): ``WithKeywords`` is the model with those constants bound, called positionally, and a later
call is run through the build when it passes the same constants (eagerly otherwise).
"""
from __future__ import annotations

import inspect
from typing import Mapping

import torch

from fxdream.capturing.arguments import check_call, keyword_split, positional_call


class WithKeywords(torch.nn.Module):
    """``model(*args, **constants)``. Its state dict is the model's own (same keys), so
    ``optimized.model.state_dict()`` saves what the model would."""

    def __init__(self, model: torch.nn.Module, constants: Mapping):
        super().__init__()
        self.model = model
        self.training = model.training  # the model's mode: a build compares its own flag with it
        self.constants = dict(constants)
        self.__dict__["_signature"] = inspect.signature(model.forward)

    def forward(self, *args):
        return self.model(*args, **self.constants)

    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.model.load_state_dict(state_dict, strict=strict, assign=assign)

    def describe(self) -> str:
        """The report's line: the constants, and what a call without them does."""
        given = ", ".join(f"{k}={v!r}" for k, v in self.constants.items())
        return (f"built for calls with {given} (keywords {type(self.model).__name__}.forward takes without a "
                f"position, bound as constants); a call without them, or with other values, runs eagerly")

    def place(self, args: tuple, kwargs: Mapping) -> tuple | None:
        """A call's arguments as the positional tuple ``forward`` takes, or None when its keywords
        without a position are not the constants this was built with (``kwargs`` by value)."""
        placed, unplaced = keyword_split(self._signature, kwargs)
        if unplaced != self.constants:
            return None
        return positional_call(self.model.forward, args, placed, self._signature)


def user_model(model: torch.nn.Module) -> torch.nn.Module:
    """The model as the user gave it: inside ``WithKeywords`` where the build bound keywords."""
    return model.model if isinstance(model, WithKeywords) else model


def bind_keywords(model: torch.nn.Module, example_inputs, example_kwargs: Mapping | None) -> tuple:
    """(model, positional example inputs): keywords with a position put there, those without
    one (keyword-only, ``**kwargs``; no tensors in them) bound by ``WithKeywords``."""
    inputs, unplaced = check_call(example_inputs, example_kwargs, model)
    return (WithKeywords(model, unplaced) if unplaced else model), inputs
