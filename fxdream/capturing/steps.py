"""One step of a model as a capture runs it: forward under no_grad, or forward and backward."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch

from fxdream.capturing.dynamo import graph_break_counts, new_graph_breaks
from fxdream.capturing.keywords import call_values
from fxdream.capturing.meta import on_meta, traceable_on_meta
from fxdream.capturing.model_state import preserved_inputs, preserved_state


def output_leaves(output) -> list:
    """The leaves of a model's output in order: pytree's (tuples, lists, dicts, named tuples,
    registered types such as Hugging Face's ModelOutput), with a dataclass instance's fields
    opened too (pytree takes an unregistered dataclass for one leaf, and its tensors would be
    neither compared nor backpropagated)."""
    leaves = []
    for leaf in torch.utils._pytree.tree_leaves(output):
        if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            leaves.extend(output_leaves([getattr(leaf, f.name) for f in dataclasses.fields(leaf)]))
        else:
            leaves.append(leaf)
    return leaves


def grad_leaves(output) -> list[torch.Tensor]:
    """The tensors among ``output``'s leaves (``output_leaves``) that require grad: what a
    backward from the output reaches."""
    return [t for t in output_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]


def differentiable_scalar(output) -> torch.Tensor | None:
    """A scalar whose backward reaches every output that requires grad (to trigger bw compile)."""
    leaves = grad_leaves(output)
    if not leaves:
        return None
    return sum(t.float().sum() for t in leaves)


def tracing_config(training: bool, meta: bool = False):
    """Inference: dynamo traces RNN modules (``allow_rnn``) instead of breaking the graph there:
    ``aten.lstm`` stays one op, exact, and in the graph the simulator sees. Training keeps the
    break: autograd's decomposed LSTM gradients differ from the fused kernel's (~1e-3 on GNMT);
    except on the meta device (``meta``: a prediction's capture, which computes nothing), where
    an RNN is traced as one op with its backward (``fxdream.ops.rnn.lstm_train``, ``rnn_train``).
    Applied while fxdream builds; a later recompile (new shape) breaks at the RNN as dynamo does
    by default, still correct (patching every call would add host time to every call)."""
    if (training and not meta) or not hasattr(torch._dynamo.config, "allow_rnn"):
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(allow_rnn=True)


def cut_from_callers_graph(inputs):
    """``inputs`` with every tensor that is the output of the caller's autograd graph (has a
    ``grad_fn``) replaced by a copy that requires grad from a detached leaf. A training step
    fxdream runs for its own ends (capture, timing, a numerics check) must not backpropagate into
    the caller's graph: it would add to the caller's ``.grad`` and free the buffers the caller's
    own backward needs. A copy, not the leaf itself: like the caller's tensor it is no leaf, so a
    forward may update it in place (``x.relu_()``), which autograd refuses on a leaf that requires
    grad. Leaves and tensors without grad pass through unchanged."""
    def cut(value):
        if isinstance(value, torch.Tensor) and value.grad_fn is not None:
            return value.detach().requires_grad_().clone()
        return value
    return torch.utils._pytree.tree_map(cut, inputs)


LOSS_RANGE = "fxdream.loss"  # profiler range of the scalar a training step backpropagates and its seed


def one_step(call: Callable, inputs: tuple, training: bool):
    """``call(*inputs)``: under no_grad in inference; in training also a backward reaching every
    output that needs a gradient (none where nothing does), never into the caller's graph that
    made the inputs. Returns the output."""
    if not training:
        with torch.no_grad():
            return call(*inputs)
    output = call(*cut_from_callers_graph(inputs))
    with torch.autograd.profiler.record_function(LOSS_RANGE):  # fxdream's loss, not the model's ops
        scalar = differentiable_scalar(output)
        seed = None if scalar is None else torch.ones_like(scalar)
    if scalar is not None:
        scalar.backward(seed)
    return output


def seeded_step(call: Callable, inputs: tuple, training: bool,
                before_each: Callable[[], None] | None = None) -> Callable[[], object]:
    """One step of ``call`` as a build times it: ``one_step``, except that in training the
    backward starts from a gradient of ones at each output that requires grad, made on the
    first step (under ``LOSS_RANGE``) and kept while the outputs keep their shapes. The same
    gradients as ``one_step``'s scalar, without its ops: a sum and an add per output, and their
    backward, ~0.1 ms a step here, 15 % of an MNIST training step, which are fxdream's and not
    the model's. ``before_each`` runs first in every step (a cache object put back)."""
    if not training:
        def inference_step():
            if before_each is not None:
                before_each()
            return one_step(call, inputs, False)
        return inference_step
    seeds: list[torch.Tensor] = []

    def step():
        if before_each is not None:
            before_each()
        output = call(*cut_from_callers_graph(inputs))
        leaves = grad_leaves(output)
        if [(s.shape, s.dtype, s.device) for s in seeds] != [(t.shape, t.dtype, t.device) for t in leaves]:
            with torch.autograd.profiler.record_function(LOSS_RANGE):
                seeds[:] = [torch.ones_like(t) for t in leaves]
        if leaves:
            torch.autograd.backward(leaves, seeds)
        return output
    return step


def run_once(compiled: Callable, model: torch.nn.Module, inputs: tuple, training: bool):
    """One forward (and backward in training) through ``compiled``, leaving no trace on the model."""
    meta = on_meta(model, inputs)
    with preserved_state(model), preserved_inputs(call_values(model, inputs)), traceable_on_meta(meta), \
            tracing_config(training, meta):
        return one_step(compiled, inputs, training)


def breaks_after_the_first_call(compiled: Callable, model: torch.nn.Module, inputs: tuple, training: bool,
                                compilations: Callable[[], int], first_breaks: tuple[str, ...]
                                ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Split the first call's graph breaks into (those later calls meet, those of the first call
    only). A model may change itself on its first call (Hugging Face BigBird swaps its attention
    module for a sequence too short for block-sparse attention): that call breaks where the
    model no longer runs, and every later call recompiles. A second step tells: where it compiled
    again, only the breaks it met are the model's. Without breaks there is nothing to split."""
    if not first_breaks:
        return (), ()
    compiled_before, breaks_before = compilations(), graph_break_counts()
    run_once(compiled, model, inputs, training)
    if compilations() == compiled_before:
        return first_breaks, ()
    later = new_graph_breaks(breaks_before)
    return later, tuple(b for b in first_breaks if b not in later)
