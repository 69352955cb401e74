"""No gradient for an input that only outputs without a gradient reach, as eager gives none.

aot_autograd runs a training graph as one ``torch.autograd.Function``, and a Function's backward
is handed zeros for the outputs the loss did not use; its backward graph then gives every input
that requires a gradient one, zeros for an input that only those outputs reach. Eager autograd
leaves such an input's ``.grad`` as it was (``None`` after ``zero_grad()``), and optimizers skip a
``None`` gradient where they move a zero one (weight decay, momentum, Adam's step): a model with
two heads trained one head per step would drift from eager.

The backward node's pre-hook sees which outputs got no gradient before they are replaced by
zeros (``UnusedOutputs.note``); the backward then returns ``None`` for each input whose reached
outputs all got none (``UnusedOutputs.drop``). Which outputs an input reaches is read from the
forward graph's data flow, which may include paths that carry no gradient (an ``argmax``): such an
input keeps its zeros, as before, never losing a real gradient. A graph where every input reaches
every differentiable output needs none of this and runs without it.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import torch
import torch.fx as fx

_AOT_BACKWARD_NODE = "CompiledFunctionBackward"


def reached_returns(fw: fx.GraphModule, returns: int) -> tuple[frozenset[int], ...]:
    """For each placeholder of ``fw`` in order, the positions among its first ``returns`` outputs
    (the autograd Function's outputs; saved activations follow them) that depend on it."""
    reached_by: dict[fx.Node, frozenset[int]] = {}
    outputs = fw.graph.output_node().args[0]
    for position, value in enumerate(outputs[:returns]):
        if isinstance(value, fx.Node):
            reached_by[value] = reached_by.get(value, frozenset()) | {position}
    for node in reversed(fw.graph.nodes):
        reached = reached_by.get(node, frozenset())
        for source in node.all_input_nodes:
            reached_by[source] = reached_by.get(source, frozenset()) | reached
    return tuple(reached_by.get(node, frozenset()) for node in fw.graph.nodes if node.op == "placeholder")


class UnusedOutputs:
    """One forward graph's inputs that reach only some of its differentiable outputs, and the
    outputs the backward node about to run got no gradient for."""

    def __init__(self):
        self.partial: dict[int, frozenset[int]] = {}  # input position → the differentiable outputs it reaches
        self._unused: frozenset[int] | None = None

    def track(self, reached: Sequence[frozenset[int]], differentiable: frozenset[int],
              requiring_gradients: frozenset[int]) -> None:
        """The forward graph's inputs' reached outputs (``reached_returns``), which outputs carry
        gradients and which inputs require one: those that reach some of the differentiable
        outputs and not all are the ones to watch (one reaching none gets no gradient already)."""
        self.partial = {position: outputs & differentiable for position, outputs in enumerate(reached)
                        if position in requiring_gradients and outputs & differentiable
                        and not differentiable <= outputs}

    @property
    def needed(self) -> bool:
        return bool(self.partial)

    def note(self, gradients: Sequence) -> None:
        """The backward node's pre-hook: its outputs' gradients, ``None`` where an output got none."""
        self._unused = frozenset(position for position, gradient in enumerate(gradients) if gradient is None)

    def drop(self, gradients: Sequence) -> list:
        """The backward graph's gradients (one per forward input), ``None`` for each input whose
        reached outputs all got no gradient in the call the last ``note`` saw."""
        unused, self._unused = self._unused, None
        gradients = list(gradients)
        if unused:
            for position, outputs in self.partial.items():
                if outputs <= unused and position < len(gradients):
                    gradients[position] = None
        return gradients

    def hooked(self, forward: Callable) -> Callable:
        """``forward`` (the compiled function dynamo calls) with a pre-hook on each call's
        backward node."""
        @functools.wraps(forward)  # keeps what aot_autograd sets on it (``zero_grad``, ``serialize``)
        def call(*args):
            outputs = forward(*args)
            node = _backward_node(outputs)
            if node is not None:
                node.register_prehook(self.note)
            return outputs
        return call

    def dropping(self, boxed_backward: Callable) -> Callable:
        """``boxed_backward`` (one list argument) returning ``drop``'s gradients."""
        def call(args):
            return self.drop(boxed_backward(args))
        call._boxed_call = True
        return call


def _backward_node(outputs) -> object | None:
    """aot_autograd's backward node for a call's outputs: an output's ``grad_fn``, or the node a
    view regenerated outside the Function hangs from."""
    for output in outputs if isinstance(outputs, (list, tuple)) else (outputs,):
        node = getattr(output, "grad_fn", None) if isinstance(output, torch.Tensor) else None
        for candidate in (node, *(n for n, _ in getattr(node, "next_functions", ()))):
            if candidate is not None and _AOT_BACKWARD_NODE in candidate.name():
                return candidate
    return None
