"""fxdream: capture a model as FX graphs, rewrite them with passes, predict and measure each pass."""
from .ab import ABResult, ABRow, ab
from .capture import Captured, CaptureError, capture
from .pass_api import Pass, PassContext, PassResult, available_passes, register_pass
from .pipeline import OptimizedModule, optimize
from .predict import Prediction, simulate
from .report import GraphReport, PassReport, Report
from .sim.profile_store import forget_profiles

__all__ = [
    "capture", "Captured", "CaptureError", "optimize", "OptimizedModule",
    "Pass", "PassContext", "PassResult", "register_pass", "available_passes",
    "Report", "GraphReport", "PassReport", "simulate", "Prediction", "ab", "ABResult", "ABRow",
    "forget_profiles",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``fxdream.cuda_graph_incompatible(op, reason)`` and ``cuda_graph_compatible(op)``: the
    registry of passes/mark_incompatible.py, loaded on first use (passes import fxdream)."""
    if name in ("cuda_graph_incompatible", "cuda_graph_compatible"):
        from .passes import mark_incompatible
        return getattr(mark_incompatible, name)
    raise AttributeError(f"module 'fxdream' has no attribute {name!r}")
