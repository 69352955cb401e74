"""What-if scenarios from Daydream (Zhu et al., ATC'20) as one-liners over TaskGraph primitives.

Each what-if takes a :class:`~fxdream.predict.Prediction` (or a bare ``TaskGraph``, or a
previous :class:`WhatIf`, so scenarios chain: ``amp(fused_optimizer(p), "h100")``), changes its
task graph (``select``, ``scale``, ``update``, ``remove``, ``insert``) and simulates it again.
The :class:`WhatIf` holds the baseline and the scenario, both *predicted*; a :class:`Measured`,
kept in its own type, where this machine can run the scenario.

    p = fxdream.simulate(model, inputs, device="h100", training=True, optimizer="adam")
    amp(p, "h100", "float16")                             # tensor-core rates, halved bytes
    fused_optimizer(p)                                    # Adam as one kernel
    faster_gpu(p, 2.0)                                    # every kernel 2x shorter
    ddp(p, Cluster(machines=2, gpus_per_machine=8, network_gbps=10))
    p3(p, Cluster(4, 1, network_gbps=10))

A prediction holds the graphs it was lowered from (``Prediction.captured``): a what-if reads
FLOPs, bytes and gradient sizes from them (``captured=`` gives others); without them the
what-ifs that can fall back on ratios do so. ``simulate``'s prediction also holds the eager code
between graphs (an RNN in training, a graph break's), which a prediction of ``capture``'s
graphs alone leaves out. Each module's docstring states its model and simplifications.
Module names differ from the function names so that ``fxdream.whatif.amp`` is the function.
"""
from fxdream.whatif.core import Measured, WhatIf, faster_gpu
from fxdream.whatif.data_parallel import (
           Cluster,
           MiB,  # noqa: F401  (public in the single-module whatif.py)
           ddp,
           ddp_buckets,
           expected_max_of_normals,
           ring_allreduce_us,
)
from fxdream.whatif.gradients import Gradient, gradients
from fxdream.whatif.measure_cpu import measure_amp_cpu, measure_fused_adam_cpu
from fxdream.whatif.mixed_precision import COMPUTE_OPS, FP32_OPS, amp, cpu_flops
from fxdream.whatif.optimizer import fused_optimizer
from fxdream.whatif.priority import ddp_period, p3

__all__ = ["WhatIf", "Measured", "Cluster", "Gradient", "amp", "fused_optimizer", "faster_gpu",
           "ddp", "ddp_period", "p3", "ring_allreduce_us", "gradients", "ddp_buckets", "expected_max_of_normals",
           "cpu_flops", "measure_amp_cpu", "measure_fused_adam_cpu",
           "COMPUTE_OPS", "FP32_OPS"]
