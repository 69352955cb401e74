"""A small 3-d residual conv net over short clips (an R3D-like video net) for A/B runs:
a user model as the CLI takes it (FILE.py:FUNCTION, FUNCTION(batch) -> (model, inputs)).

    python -m fxdream ab benchmarks/video_like.py:build --pass fuse_conv_bias_act --batch 1,4
"""
import torch
import torch.nn as nn


class Block(nn.Module):
    """conv → BN → ReLU → conv → BN, plus the input (1x1x1 conv + BN where the shape changes), then ReLU."""

    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.body = nn.Sequential(nn.Conv3d(c_in, c_out, 3, stride, 1, bias=False), nn.BatchNorm3d(c_out), nn.ReLU(),
                                  nn.Conv3d(c_out, c_out, 3, 1, 1, bias=False), nn.BatchNorm3d(c_out))
        self.shortcut = nn.Identity() if stride == 1 and c_in == c_out else \
            nn.Sequential(nn.Conv3d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm3d(c_out))

    def forward(self, x):
        return torch.relu(self.body(x) + self.shortcut(x))


def build(batch, frames=8, size=64):
    """(model in train mode, a batch of RGB clips); eval() it for inference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv3d(3, 32, (3, 7, 7), (1, 2, 2), (1, 3, 3), bias=False), nn.BatchNorm3d(32), nn.ReLU(),
                          Block(32, 32, 1), Block(32, 64, 2), Block(64, 64, 1),
                          nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(64, 10))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm3d):  # statistics of a trained net, not the identity
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return model, torch.randn(batch, 3, frames, size, size)
