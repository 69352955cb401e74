"""fxdream: capture a model as FX graphs, rewrite them with passes, predict and measure each pass."""
from .ab import ABResult, ABRow, ab
from .capture import Captured, CaptureError, capture
from .pass_api import Pass, PassContext, PassResult, available_passes, register_pass
from .pipeline import OptimizedModule, optimize
from .predict import Prediction, simulate
from .report import GraphReport, PassReport, Report

__all__ = [
    "capture", "Captured", "CaptureError", "optimize", "OptimizedModule",
    "Pass", "PassContext", "PassResult", "register_pass", "available_passes",
    "Report", "GraphReport", "PassReport", "simulate", "Prediction", "ab", "ABResult", "ABRow",
]
__version__ = "0.1.0"
