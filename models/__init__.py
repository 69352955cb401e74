"""The model zoo: the workloads fxdream is evaluated on, written in plain torch.nn.

``build(name, batch_size)`` returns a randomly initialised model with an example batch
and a loss, all deterministic, so that two runs (or a prediction and a measurement) see
exactly the same work. Each family has a full config (the published architecture) and a
``tiny`` one with the same structure for fast tests.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fxdream.models import bert, densenet, gnmt, mnist, resnet, vgg

NAMES = ("resnet18", "resnet50", "vgg19", "densenet121", "mnist_convnet", "bert_base", "gnmt")

_FAMILIES = {
    "resnet18": resnet,
    "resnet50": resnet,
    "vgg19": vgg,
    "densenet121": densenet,
    "mnist_convnet": mnist,
    "bert_base": bert,
    "gnmt": gnmt,
}

WEIGHT_SEED = 0
DATA_SEED = 1


def build(name: str, batch_size: int, tiny: bool = False, device="cpu", dtype: torch.dtype = torch.float32):
    """Return ``(model, example_inputs, loss_fn)`` for one training step of ``name``.

    The model is in train() mode on ``device``/``dtype``; ``example_inputs`` is a tuple of
    tensors (token ids stay ``torch.long``); ``loss_fn(output)`` is cross-entropy against
    seeded random labels. The global RNG state is left untouched. ``device="meta"``
    builds without allocating memory, e.g. to count parameters of the full models.
    """
    if name not in _FAMILIES:
        hint = f" (a model of your own: {name}:FUNCTION)" if name.endswith(".py") else ""
        raise ValueError(f"unknown model {name!r}{hint}; valid names: {', '.join(NAMES)}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r} "
                         f"(for model {name!r}; valid names: {', '.join(NAMES)})")
    family = _FAMILIES[name]
    device = torch.device(device)

    model = _init_model(lambda: family.build_model(name, tiny), device)
    model = model.to(device=device, dtype=dtype).train()

    # Data is drawn on the CPU from a private generator: identical on every device.
    generator = torch.Generator().manual_seed(DATA_SEED)
    inputs, labels = family.example_batch(name, batch_size, tiny, generator)
    inputs = tuple(t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype) for t in inputs)
    labels = labels.to(device)

    def loss_fn(output: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy in float32 (per token when the output is [B, T, classes])."""
        return F.cross_entropy(output.float().flatten(0, -2), labels.flatten())

    return model, inputs, loss_fn


def _init_model(make, device: torch.device) -> nn.Module:
    """Run ``make`` with a fixed CPU seed, restoring the caller's RNG state afterwards.

    Weights are initialised on the CPU whatever the target device, so they do not depend
    on the device's RNG; only ``meta`` is built in place, to skip allocation.
    """
    with torch.random.fork_rng(devices=[]):
        torch.random.default_generator.manual_seed(WEIGHT_SEED)
        with torch.device("meta" if device.type == "meta" else "cpu"):
            return make()


__all__ = ["NAMES", "build"]
