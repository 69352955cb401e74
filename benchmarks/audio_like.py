"""A 1-d residual conv net over a waveform-like signal (a TCN / audio front end) for A/B runs:
a user model as the CLI takes it (FILE.py:FUNCTION, FUNCTION(batch) -> (model, inputs)).

    python -m fxdream ab benchmarks/audio_like.py:build --pass fuse_conv_bias_act --batch 1,8
"""
import torch
import torch.nn as nn


class Block(nn.Module):
    """conv → BN → ReLU → conv → BN, plus the input, then ReLU (a ResNet basic block in 1-d)."""

    def __init__(self, c, dilation):
        super().__init__()
        self.body = nn.Sequential(nn.Conv1d(c, c, 3, padding=dilation, dilation=dilation, bias=False),
                                  nn.BatchNorm1d(c), nn.ReLU(),
                                  nn.Conv1d(c, c, 3, padding=1, bias=False), nn.BatchNorm1d(c))

    def forward(self, x):
        return torch.relu(self.body(x) + x)


def build(batch, channels=128, length=4096):
    """(model in train mode, a batch of 1-channel signals); eval() it for inference."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, channels, 7, stride=2, padding=3, bias=False), nn.BatchNorm1d(channels),
                          nn.ReLU(), *[Block(channels, d) for d in (1, 2, 4, 8)],
                          nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(channels, 10))
    for m in model.modules():
        if isinstance(m, nn.BatchNorm1d):  # statistics of a trained net, not the identity
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return model, torch.randn(batch, 1, length)
