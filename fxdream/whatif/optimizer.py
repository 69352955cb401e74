"""Fused-optimizer what-if: the optimizer's tasks (phase ``"optim"``: per parameter, or torch's
multi-tensor ops on a GPU) collapse into one launch and one kernel moving one pass over the
optimizer state (``OptimizerModel.bytes_per_grad_byte``), as the lowering models ``fused=True``.
"""
from __future__ import annotations

from fxdream.ir.tensors import tensor_bytes
from fxdream.sim.lower import gradient_values
from fxdream.sim.optimizer_step import optimizer_in
from fxdream.sim.taskgraph import TaskKind
from fxdream.whatif.core import WhatIf, _finish, _graphs_by_label, _spec, _start, _with_durations, call_scopes


def fused_optimizer(x, *, captured=None, graphs=None, device=None,
                    contention: bool | None = None) -> WhatIf:
    """What if the optimizer were one fused kernel (e.g. ``Adam(fused=True)``) instead of
    ``kernels_per_param`` kernels per parameter (``foreach_ops`` multi-tensor ops on a GPU)?
    One launch, one kernel moving the summed bytes: one pass over the state
    (``OptimizerModel.bytes_per_grad_byte``, whatever the implementation moved) × the gradients
    of the captured backwards (and of the parameters only eager code uses,
    ``Prediction.outside_gradient_bytes``); without ``captured`` they are read back from the optimizer's
    kernel times (bytes = time × bandwidth; kernels at the device's floor count 0: a lower bound)."""
    s = _start(x, device, captured, graphs, contention)
    tg = s.current.task_graph
    optim, model, on_gpu = optimizer_in(tg)
    if not optim:
        raise ValueError("no optimizer tasks (phase 'optim'): predict a training step with an "
                         "optimizer (simulate(..., training=True, optimizer='adam'))")
    spec = _spec(device) or s.current.device
    host = [n for n in optim if tg.task(n).kind is not TaskKind.GPU]
    kernels = [n for n in optim if tg.task(n).kind is TaskKind.GPU]
    per_param = model.kernels_per_param if model else 1
    launch = spec.dispatch_overhead_us + (spec.launch_overhead_us if on_gpu else 0.0)
    bw = spec.mem_bandwidth
    by_label = _graphs_by_label(s.captured, s.graphs)
    bw_graphs = [(label, gm) for label, gm in by_label.items() if label.endswith(".bw")]
    if model is not None and bw_graphs:
        # the lowering's optimizer updates the gradients of every backward call (a graph called
        # per layer computes each layer's gradients)
        calls = {f"g{index}.bw": len(scopes) for index, scopes in call_scopes(tg).items()}
        nbytes = model.bytes_per_grad_byte * (sum(calls.get(label, 1) * tensor_bytes(g) for label, gm in bw_graphs
                                                  for g in gradient_values(gm)) + s.current.outside_gradient_bytes)
        source = "captured gradients" + (" and eager code's" if s.current.outside_gradient_bytes else "")
    else:
        times = [tg.task(n).duration_us for n in kernels] if on_gpu else \
                [max(tg.task(n).duration_us - per_param * launch, 0.0) for n in host]
        floor = per_param * spec.kernel_min_us * (1 + 1e-9)
        nbytes = sum(t for t in times if t > floor) * bw / 1e6
        source = ("per-parameter kernel times x bandwidth (kernels at the device's floor "
                  "count 0: a lower bound)")
    kernel_us = spec.kernel_time_us(0, nbytes)  # one memory-bound kernel over every parameter
    keep_host, keep_kernel = host[0], (kernels[0] if kernels else None)
    before_ms = sum(tg.task(n).duration_us for n in optim) / 1e3
    durations = {keep_host: launch if on_gpu else launch + kernel_us}
    if keep_kernel:
        durations[keep_kernel] = kernel_us
    fused = _with_durations(tg, durations).remove([n for n in optim if n not in durations])
    details = {"fused.replaced_tasks": len(optim), "fused.tasks": len(durations),
               "fused.bytes": int(nbytes), "fused.bytes_source": source,
               "fused.optimizer_busy_ms_before": before_ms,
               "fused.optimizer_busy_ms_after": sum(durations.values()) / 1e3}
    return _finish(s, f"fused {model.name if model else tg.task(optim[0]).op}", fused, details)
