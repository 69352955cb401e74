"""A MobileNetV3-like net (hardswish or SiLU, depthwise convs, inverted residuals) for A/B runs:
a user model as the CLI takes it (FILE.py:FUNCTION, FUNCTION(batch) -> (model, inputs)).

    python -m fxdream ab benchmarks/mobile_like.py:build --pass fuse_conv_bias_act --batch 1,8
    python -m fxdream ab benchmarks/mobile_like.py:build_silu --pass fuse_conv_bias_act --batch 1,8
"""
import torch
import torch.nn as nn


class Block(nn.Module):
    """Inverted residual: 1x1 expand → 3x3 depthwise → 1x1 project, BN after each."""

    def __init__(self, c, e, act, stride=1):
        super().__init__()
        h = c * e
        self.body = nn.Sequential(nn.Conv2d(c, h, 1, bias=False), nn.BatchNorm2d(h), act(),
                                  nn.Conv2d(h, h, 3, stride, 1, groups=h, bias=False), nn.BatchNorm2d(h), act(),
                                  nn.Conv2d(h, c, 1, bias=False), nn.BatchNorm2d(c))
        self.residual = stride == 1

    def forward(self, x):
        y = self.body(x)
        return x + y if self.residual else y


def build(batch, act=nn.Hardswish):
    """(model in train mode, a 224x224 batch); eval() it for inference."""
    torch.manual_seed(0)
    layers = [nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), act()]
    for c, n, stride in ((16, 2, 2), (16, 2, 1), (16, 2, 2), (16, 2, 1)):
        layers += [Block(c, 4, act, stride)] + [Block(c, 4, act) for _ in range(n - 1)]
    model = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):  # statistics of a trained net, not the identity
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return model, torch.randn(batch, 3, 224, 224)


def build_silu(batch):
    return build(batch, nn.SiLU)
