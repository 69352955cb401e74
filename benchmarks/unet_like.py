"""A small U-Net (conv+BN+ReLU pairs, max pooling, bilinear upsampling, skip concatenations)
for A/B runs: a user model as the CLI takes it (FILE.py:FUNCTION, FUNCTION(batch) -> (model, inputs)).

    python -m fxdream ab benchmarks/unet_like.py:build --pass fuse_conv_bias_act --batch 1,4
"""
import torch
import torch.nn as nn
import torch.nn.functional as F


def _pair(cin, cout):
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True),
                         nn.Conv2d(cout, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class UNet(nn.Module):
    def __init__(self, widths=(16, 32, 64, 128), classes=3):
        super().__init__()
        self.down = nn.ModuleList(_pair(cin, cout) for cin, cout in zip((3, *widths[:-1]), widths))
        self.up = nn.ModuleList(_pair(wide + narrow, narrow) for wide, narrow in zip(widths[:0:-1], widths[-2::-1]))
        self.head = nn.Conv2d(widths[0], classes, 1)

    def forward(self, x):
        skips = []
        for i, block in enumerate(self.down):
            x = block(x if i == 0 else F.max_pool2d(x, 2))
            skips.append(x)
        for block, skip in zip(self.up, reversed(skips[:-1])):
            x = block(torch.cat([F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=False), skip], 1))
        return self.head(x)


def build(batch):
    """(model in train mode, a 128x128 batch); eval() it for inference."""
    torch.manual_seed(0)
    model = UNet()
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):  # statistics of a trained net, not the identity
            m.running_mean.uniform_(-0.2, 0.2)
            m.running_var.uniform_(0.5, 1.5)
    return model, torch.randn(batch, 3, 128, 128)
