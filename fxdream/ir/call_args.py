"""A torch function's call, as a redirect sees it: its arguments by name."""
from __future__ import annotations


def bind(args: tuple, kwargs: dict, names: tuple, defaults: tuple) -> dict | None:
    """Arguments by name: ``defaults``, then the positional ones, then the keywords; None for a
    call with more positional arguments than ``names`` or a keyword not among them."""
    if len(args) > len(names) or set(kwargs) - set(names):
        return None
    values = dict(zip(names, defaults))
    values.update(zip(names, args))
    values.update(kwargs)
    return values
