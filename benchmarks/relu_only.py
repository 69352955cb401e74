"""A pass plugin for A/B runs: fuse_conv_bias_act as it was before it fused SiLU / hardswish / ReLU6 /
sigmoid / tanh (ReLU only), to measure what those post-ops add:

    python -m fxdream ab benchmarks/mobile_like.py:build --pass fuse_conv_bias_act --load benchmarks/relu_only.py
"""
from fxdream.passes.fuse_conv_bias_act import sites as conv_sites  # fuse_conv_bias_act's matcher

conv_sites.INFERENCE_ACTS.clear()
