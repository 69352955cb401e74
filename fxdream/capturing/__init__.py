"""Capture: a model as ATen-level FX graphs (forward, and backward in training), each node tied
to its layer, by torch.fx, dynamo or block by block; and the host time around the graphs."""
from fxdream.capturing.capture_model import capture, capture_with_host_gaps
from fxdream.capturing.captured import Captured, CaptureError, LayerStats
from fxdream.capturing.session import CaptureSession

__all__ = ["capture", "capture_with_host_gaps", "Captured", "CaptureError", "LayerStats", "CaptureSession"]
