"""The Flux model-zoo MNIST conv net (``vision/conv_mnist``), ported to torch.nn.

It is small enough that per-op dispatch overhead, not FLOPs, dominates its step time,
and its conv + bias + ReLU triples are the textbook fusion target.
"""
from __future__ import annotations

import torch
from torch import nn

IMAGE_SIZE = 28
NUM_CLASSES = 10


class MnistConvNet(nn.Module):
    """Three (conv 3x3 with bias, ReLU, 2x2 max pool) stages, then one dense layer.

    28 -> 14 -> 7 -> 3 pixels, so the classifier sees 32 * 3 * 3 = 288 features.
    """

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 32, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.classifier = nn.Linear(288, NUM_CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def build_model(name: str, tiny: bool) -> MnistConvNet:
    """Already tiny: the tiny config is the full model."""
    return MnistConvNet()


def example_batch(name: str, batch_size: int, tiny: bool, generator: torch.Generator):
    """((images,), digit labels) for one training step."""
    images = torch.randn(batch_size, 1, IMAGE_SIZE, IMAGE_SIZE, generator=generator)
    labels = torch.randint(0, NUM_CLASSES, (batch_size,), generator=generator)
    return (images,), labels
