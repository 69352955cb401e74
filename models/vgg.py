"""VGG-19 (configuration "E", no batch norm) with torchvision's module layout.

``features.N`` and ``classifier.N`` indices match torchvision, so a layer label such as
``features.0`` means the same conv here as there.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fxdream.models.images import image_batch

POOL = "M"


@dataclass(frozen=True)
class VGGConfig:
    features: tuple          # conv widths, with POOL for a 2x2 max pool
    hidden: int              # width of the two hidden classifier layers
    image_size: int
    num_classes: int
    dropout: float = 0.5


_VGG19 = (64, 64, POOL, 128, 128, POOL, 256, 256, 256, 256, POOL,
          512, 512, 512, 512, POOL, 512, 512, 512, 512, POOL)

CONFIGS = {
    ("vgg19", False): VGGConfig(_VGG19, 4096, 224, 1000),
    # Same 16 convs and 5 pools at 1/8 width; 32x32 ends at 1x1, which the adaptive pool
    # replicates to 7x7 exactly as torchvision does for small inputs.
    ("vgg19", True): VGGConfig(tuple(v if v == POOL else v // 8 for v in _VGG19), 64, 32, 10),
}


def make_features(widths: tuple) -> nn.Sequential:
    layers: list[nn.Module] = []
    in_channels = 3
    for v in widths:
        if v == POOL:
            layers.append(nn.MaxPool2d(kernel_size=2, stride=2))
        else:
            layers += [nn.Conv2d(in_channels, v, kernel_size=3, padding=1), nn.ReLU(inplace=True)]
            in_channels = v
    return nn.Sequential(*layers)


class VGG(nn.Module):
    def __init__(self, config: VGGConfig):
        super().__init__()
        last_width = [v for v in config.features if v != POOL][-1]
        self.features = make_features(config.features)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Linear(last_width * 7 * 7, config.hidden),
            nn.ReLU(True),
            nn.Dropout(p=config.dropout),
            nn.Linear(config.hidden, config.hidden),
            nn.ReLU(True),
            nn.Dropout(p=config.dropout),
            nn.Linear(config.hidden, config.num_classes),
        )
        self._init_weights()

    def _init_weights(self) -> None:
        """torchvision's init: He for convs, N(0, 0.01) for the classifier, zero biases."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.avgpool(self.features(x))
        return self.classifier(torch.flatten(x, 1))


def build_model(name: str, tiny: bool) -> VGG:
    return VGG(CONFIGS[name, tiny])


def example_batch(name: str, batch_size: int, tiny: bool, generator: torch.Generator):
    return image_batch(CONFIGS[name, tiny], batch_size, generator)
