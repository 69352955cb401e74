"""DenseNet-121 with torchvision's module layout.

Names such as ``features.denseblock1.denselayer1.norm1`` and ``features.transition1.conv``
match torchvision. The dense layers concatenate every earlier feature map, so the graph
is full of ``cat`` nodes: a good stress test for memory-layout passes.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from fxdream.models.images import image_batch


@dataclass(frozen=True)
class DenseNetConfig:
    growth_rate: int
    block_config: tuple[int, ...]
    num_init_features: int
    image_size: int
    num_classes: int
    bn_size: int = 4


CONFIGS = {
    ("densenet121", False): DenseNetConfig(32, (6, 12, 24, 16), 64, 224, 1000),
    # 64x64 images leave the last block 2x2, as the tiny ResNets (BatchNorm in training at batch 1)
    ("densenet121", True): DenseNetConfig(8, (2, 2, 2, 2), 16, 64, 10),
}


class DenseLayer(nn.Module):
    """BN-ReLU-1x1 bottleneck then BN-ReLU-3x3 producing ``growth_rate`` new channels."""

    def __init__(self, num_input_features: int, growth_rate: int, bn_size: int):
        super().__init__()
        self.norm1 = nn.BatchNorm2d(num_input_features)
        self.relu1 = nn.ReLU(inplace=True)
        self.conv1 = nn.Conv2d(num_input_features, bn_size * growth_rate, kernel_size=1, stride=1, bias=False)
        self.norm2 = nn.BatchNorm2d(bn_size * growth_rate)
        self.relu2 = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(bn_size * growth_rate, growth_rate, kernel_size=3, stride=1, padding=1, bias=False)

    def forward(self, previous_features: list[torch.Tensor]) -> torch.Tensor:
        concatenated = torch.cat(previous_features, 1)
        bottleneck = self.conv1(self.relu1(self.norm1(concatenated)))
        return self.conv2(self.relu2(self.norm2(bottleneck)))


class DenseBlock(nn.ModuleDict):
    """A ModuleDict (as in torchvision) so children are named ``denselayerN``."""

    def __init__(self, num_layers: int, num_input_features: int, growth_rate: int, bn_size: int):
        super().__init__()
        for i in range(num_layers):
            layer = DenseLayer(num_input_features + i * growth_rate, growth_rate, bn_size)
            self.add_module(f"denselayer{i + 1}", layer)

    def forward(self, init_features: torch.Tensor) -> torch.Tensor:
        features = [init_features]
        for layer in self.values():
            features.append(layer(features))
        return torch.cat(features, 1)


class Transition(nn.Sequential):
    """Halves channels (1x1 conv) and spatial size (2x2 average pool) between blocks."""

    def __init__(self, num_input_features: int, num_output_features: int):
        super().__init__()
        self.norm = nn.BatchNorm2d(num_input_features)
        self.relu = nn.ReLU(inplace=True)
        self.conv = nn.Conv2d(num_input_features, num_output_features, kernel_size=1, stride=1, bias=False)
        self.pool = nn.AvgPool2d(kernel_size=2, stride=2)


class DenseNet(nn.Module):
    def __init__(self, config: DenseNetConfig):
        super().__init__()
        num_features = config.num_init_features
        self.features = nn.Sequential(OrderedDict([
            ("conv0", nn.Conv2d(3, num_features, kernel_size=7, stride=2, padding=3, bias=False)),
            ("norm0", nn.BatchNorm2d(num_features)),
            ("relu0", nn.ReLU(inplace=True)),
            ("pool0", nn.MaxPool2d(kernel_size=3, stride=2, padding=1)),
        ]))
        for i, num_layers in enumerate(config.block_config):
            block = DenseBlock(num_layers, num_features, config.growth_rate, config.bn_size)
            self.features.add_module(f"denseblock{i + 1}", block)
            num_features += num_layers * config.growth_rate
            if i != len(config.block_config) - 1:
                self.features.add_module(f"transition{i + 1}", Transition(num_features, num_features // 2))
                num_features //= 2
        self.features.add_module("norm5", nn.BatchNorm2d(num_features))
        self.classifier = nn.Linear(num_features, config.num_classes)
        self._init_weights()

    def _init_weights(self) -> None:
        """torchvision's init: He for convs, unit BN, zero classifier bias."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)
            elif isinstance(m, nn.Linear):
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.features(x), inplace=True)
        out = torch.flatten(F.adaptive_avg_pool2d(out, (1, 1)), 1)
        return self.classifier(out)


def build_model(name: str, tiny: bool) -> DenseNet:
    return DenseNet(CONFIGS[name, tiny])


def example_batch(name: str, batch_size: int, tiny: bool, generator: torch.Generator):
    return image_batch(CONFIGS[name, tiny], batch_size, generator)
