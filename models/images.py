"""The batch every image classifier of the zoo trains on: random images and class labels."""
from __future__ import annotations

import torch


def image_batch(config, batch_size: int, generator: torch.Generator):
    """((images,), class labels) for one training step of a model with ``config.image_size``
    and ``config.num_classes``."""
    size = config.image_size
    images = torch.randn(batch_size, 3, size, size, generator=generator)
    labels = torch.randint(0, config.num_classes, (batch_size,), generator=generator)
    return (images,), labels
