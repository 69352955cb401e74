"""fxdream: capture a model as FX graphs, rewrite them with passes, predict and measure each pass."""
from fxdream import explain, models, whatif  # fxdream.explain.crossover, fxdream.whatif.amp after `import fxdream`
from fxdream.ab import ABResult, ABRow, ab
from fxdream.build import optimize
from fxdream.capturing.capture_model import capture
from fxdream.capturing.captured import Captured, CaptureError
from fxdream.optimized_module import OptimizedModule
from fxdream.pass_api import Pass, PassContext, PassResult, register_pass
from fxdream.pass_registry import available_passes
from fxdream.passes.mark_incompatible.registry import cuda_graph_compatible, cuda_graph_incompatible
from fxdream.report import GraphReport, PassReport, Report
from fxdream.runtime.host_memory import FreedMemoryKept, keep_freed_memory
from fxdream.sim.prediction import Prediction
from fxdream.sim.profile.store import forget_profiles
from fxdream.simulation import simulate

__all__ = [
    "capture", "Captured", "CaptureError", "optimize", "OptimizedModule",
    "Pass", "PassContext", "PassResult", "register_pass", "available_passes",
    "Report", "GraphReport", "PassReport", "simulate", "Prediction", "ab", "ABResult", "ABRow",
    "forget_profiles", "keep_freed_memory", "FreedMemoryKept",
    "cuda_graph_incompatible", "cuda_graph_compatible", "explain", "models", "whatif",
]
__version__ = "0.1.0"

