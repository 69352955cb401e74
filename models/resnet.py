"""ResNet-18 and ResNet-50 with torchvision's module layout.

Attribute names (``conv1``, ``layer1.0.downsample.0``, ``fc``...) match torchvision so that
layer labels in fxdream reports read the same as in papers and profilers, and so a
torchvision state_dict would load unchanged.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fxdream.models.images import image_batch


@dataclass(frozen=True)
class ResNetConfig:
    block: str            # "basic" (ResNet-18/34) or "bottleneck" (ResNet-50 and up)
    layers: tuple[int, int, int, int]
    base_width: int       # channels of the stem; each stage doubles it
    image_size: int
    num_classes: int


CONFIGS = {
    ("resnet18", False): ResNetConfig("basic", (2, 2, 2, 2), 64, 224, 1000),
    ("resnet50", False): ResNetConfig("bottleneck", (3, 4, 6, 3), 64, 224, 1000),
    # One block per stage still gives a downsample branch in every stage but the first
    # (and in layer1 too for the bottleneck, whose expansion changes the channel count).
    # 64x64 images leave the last stage 2x2: BatchNorm in training needs more than one value
    # per channel, which a 1x1 map at batch 1 does not give.
    ("resnet18", True): ResNetConfig("basic", (1, 1, 1, 1), 8, 64, 10),
    ("resnet50", True): ResNetConfig("bottleneck", (1, 1, 1, 1), 8, 64, 10),
}


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


def conv1x1(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=1, stride=stride, bias=False)


class BasicBlock(nn.Module):
    """Two 3x3 convs plus the identity (or a 1x1 projection when the shape changes)."""
    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided, as in torchvision's "ResNet v1.5"), 1x1 expand by 4."""
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = conv1x1(inplanes, planes)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = conv3x3(planes, planes, stride)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = conv1x1(planes, planes * self.expansion)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    def __init__(self, config: ResNetConfig):
        super().__init__()
        block = BasicBlock if config.block == "basic" else Bottleneck
        width = config.base_width
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(block, width, config.layers[0])
        self.layer2 = self._make_layer(block, width * 2, config.layers[1], stride=2)
        self.layer3 = self._make_layer(block, width * 4, config.layers[2], stride=2)
        self.layer4 = self._make_layer(block, width * 8, config.layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * block.expansion, config.num_classes)
        self._init_weights()

    def _make_layer(self, block, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * block.expansion:
            downsample = nn.Sequential(
                conv1x1(self.inplanes, planes * block.expansion, stride),
                nn.BatchNorm2d(planes * block.expansion),
            )
        layers = [block(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * block.expansion
        layers += [block(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def _init_weights(self) -> None:
        """torchvision's init, so activations have realistic scale (matters for timing denormals)."""
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.constant_(m.weight, 1)
                nn.init.constant_(m.bias, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(self.avgpool(x), 1)
        return self.fc(x)


def build_model(name: str, tiny: bool) -> ResNet:
    return ResNet(CONFIGS[name, tiny])


def example_batch(name: str, batch_size: int, tiny: bool, generator: torch.Generator):
    return image_batch(CONFIGS[name, tiny], batch_size, generator)
