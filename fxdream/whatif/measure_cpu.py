"""Scenarios this machine can run for real (CPU): the :class:`Measured` counterparts of
:func:`amp` and :func:`fused_optimizer`, timed with interleaved blocks (never simulated).
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

from fxdream.capturing.steps import cut_from_callers_graph, differentiable_scalar
from fxdream.measure import time_interleaved
from fxdream.whatif.core import Measured
from fxdream.whatif.mixed_precision import _DTYPES


def _interleaved(runners: Mapping[str, Any], rounds: int, block: int) -> dict[str, float]:
    """Median ms per call of each runner, blocks of the runners alternated."""
    res = time_interleaved(runners, rounds=rounds, block=block, warmup=2, progress=False)
    return {k: v.median_ms for k, v in res.items()}


def measure_amp_cpu(model: torch.nn.Module, inputs, loss_fn=None, dtype: str = "bfloat16",
                    rounds: int = 5, block: int = 2) -> Measured:
    """Eager training step (forward + backward + SGD) in float32 vs under
    ``torch.autocast("cpu", dtype)``, interleaved blocks, on this CPU."""
    low = _DTYPES[dtype]
    loss_fn = loss_fn or differentiable_scalar  # every output that needs a gradient, summed
    inputs = cut_from_callers_graph(tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6, momentum=0.9)
    model.train()

    def step(autocast: bool):
        def run():
            opt.zero_grad(set_to_none=True)
            with torch.autocast("cpu", dtype=low, enabled=autocast):
                out = model(*inputs)
            loss_fn(out).backward()
            opt.step()
        return run
    with torch.random.fork_rng(devices=[]):
        state = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            ms = _interleaved({"fp32": step(False), dtype: step(True)}, rounds, block)
        finally:
            model.load_state_dict(state)
            opt.zero_grad(set_to_none=True)
    return Measured(ms["fp32"], ms[dtype], f"eager training step, fp32 vs autocast {dtype}, "
                    f"{torch.get_num_threads()} thread(s), median of {rounds} blocks of {block}")


def measure_fused_adam_cpu(model: torch.nn.Module, rounds: int = 5, block: int = 5) -> Measured:
    """``Adam(foreach=False)`` (per-parameter kernels) vs ``Adam(fused=True)``: the optimizer
    step alone, on gradients already in place, on this CPU."""
    params = [p for p in model.parameters() if p.requires_grad]
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    per_param = torch.optim.Adam(params, lr=1e-9, foreach=False)
    fused = torch.optim.Adam(params, lr=1e-9, fused=True)
    try:
        ms = _interleaved({"per_param": per_param.step, "fused": fused.step}, rounds, block)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved):
                p.copy_(s)
                p.grad = None
    return Measured(ms["per_param"], ms["fused"], f"Adam step only, foreach=False vs fused=True, "
                    f"{torch.get_num_threads()} thread(s), median of {rounds} blocks of {block}")
