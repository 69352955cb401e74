"""The optimizer step as tasks: what it moves, the kernels it launches, the memory it holds.

``OptimizerModel`` says how torch's optimizers run (a loop over the parameters on a CPU, a
multi-tensor step on a GPU, one fused kernel); ``append_optimizer_step`` adds a step's tasks
after the last backward (``lower``), or a P3 what-if's per-parameter updates."""
from __future__ import annotations

import math
from dataclasses import dataclass

from fxdream.sim.taskgraph import DepKind, Task, TaskGraph, TaskKind


@dataclass(frozen=True)
class OptimizerModel:
    """The optimizer step as kernels: bytes moved per gradient byte, kernels per parameter.

    SGD with momentum reads p, g, buf and writes p, buf (5x); SGD without (torch's default,
    ``momentum=0``) reads p, g and writes p (3x), and keeps no state; Adam reads p, g, m, v and
    writes p, m, v (7x). ``fused=True`` is one kernel for all parameters. Otherwise torch's
    default: on a CPU a loop over the parameters (``kernels_per_param`` each); on a GPU
    (``foreach``) its multi-tensor implementation, ``foreach_ops`` ops for all parameters (SGD:
    buf·momentum, buf + g, p − lr·buf; Adam: lerp, mul, addcmul, sqrt, div, add, addcdiv),
    each launching a kernel per group of tensors; ``foreach=False`` is the loop there too
    (torch's ``foreach=False``, or P3's updates as each gradient arrives). Its state (momentum;
    Adam's two moments) is ``state_copies`` tensors the size of each updated parameter, made
    on the first step and kept: static memory in every step after it.
    """
    name: str = "sgd"
    bytes_per_grad_byte: float = 5.0
    kernels_per_param: int = 2
    fused: bool = False
    state_copies: int = 1
    foreach_ops: int = 3
    foreach: bool = True
    # Memory an unfused step holds besides its state, in sizes of the parameters it updates:
    # torch's Adam makes sqrt(v), then its quotient by the bias correction, before its addcdiv.
    # Its loop holds both for one parameter at a time; its multi-tensor step holds sqrt(v) of
    # every parameter at once, through its last ``foreach_temporary_ops`` ops (sqrt to addcdiv).
    loop_temporaries: float = 0.0
    foreach_temporaries: float = 0.0
    foreach_temporary_ops: int = 0
    # (bytes, elements) of each gradient of a parameter no captured graph takes (eager code's),
    # which the step updates beside the graphs' gradients
    outside_gradients: tuple[tuple[int, int], ...] = ()


SGD = OptimizerModel("sgd", 5.0, 2, state_copies=1, foreach_ops=3)
PLAIN_SGD = OptimizerModel("sgd_plain", 3.0, 1, state_copies=0, foreach_ops=1)  # p − lr·g
ADAM = OptimizerModel("adam", 7.0, 5, state_copies=2, foreach_ops=7, loop_temporaries=2.0, foreach_temporaries=1.0,
                      foreach_temporary_ops=4)
# torch's multi_tensor_apply (ATen/native/cuda/MultiTensorApply.cuh): one launch holds at most
# 64 tensors (two tensor lists) and 320 blocks of 65536 elements
FOREACH_TENSORS_PER_LAUNCH, FOREACH_ELEMENTS_PER_LAUNCH = 64, 320 * 65536
# "sgd" is SGD with momentum, as models are usually trained; "sgd_plain" torch's SGD(momentum=0)
OPTIMIZERS = {"sgd": SGD, "sgd_plain": PLAIN_SGD, "adam": ADAM}


def append_optimizer_step(tg: TaskGraph, gradients: list[tuple[int, int]], device, optimizer: OptimizerModel,
                          on_gpu: bool) -> None:
    """Tasks ``optim:<i>`` (and ``optim:<i>:k``, a kernel on a GPU) updating ``gradients``
    ((bytes, elements) each): one per parameter on a CPU or without ``foreach``, one per
    multi-tensor op on a GPU, one when fused (see OptimizerModel)."""
    if not gradients:
        return
    launch = device.dispatch_overhead_us + (device.launch_overhead_us if on_gpu else 0.0)
    moved = [optimizer.bytes_per_grad_byte * nbytes for nbytes, _ in gradients]
    if optimizer.fused:
        steps = [(sum(moved), 1, launch)]
        memory = [(0, 0)]
    elif not on_gpu or not optimizer.foreach:
        steps = [(m, optimizer.kernels_per_param, optimizer.kernels_per_param * launch) for m in moved]
        memory = [(round(optimizer.loop_temporaries * nbytes),) * 2 for nbytes, _ in gradients]
    else:
        launches = max(math.ceil(len(gradients) / FOREACH_TENSORS_PER_LAUNCH),
                       math.ceil(sum(elements for _, elements in gradients) / FOREACH_ELEMENTS_PER_LAUNCH))
        host_us = device.dispatch_overhead_us + launches * device.launch_overhead_us
        steps = [(sum(moved) / optimizer.foreach_ops, launches, host_us)] * optimizer.foreach_ops
        memory = _foreach_temporaries(optimizer, sum(nbytes for nbytes, _ in gradients))
    common = dict(layer="", op=f"optimizer.{optimizer.name}", phase="optim")
    for i, ((nbytes, kernels, host_us), (alloc, free)) in enumerate(zip(steps, memory)):
        kernel_us = device.kernel_time_us(0, nbytes, kernels=kernels)  # memory-bound, as the fused what-if's
        name = f"optim:{i}"
        held = dict(mem_alloc=alloc, mem_free=free)  # on the task that runs the op: the device's memory
        if not on_gpu:
            tg.append(Task(name, TaskKind.CPU, host_us + kernel_us, "cpu:0", **common, **held))
        else:
            tg.append(Task(name, TaskKind.CPU, host_us, "cpu:0", **common))
            tg.append(Task(f"{name}:k", TaskKind.GPU, kernel_us, "stream:0", **common, **held),
                      deps=[(name, DepKind.LAUNCH)])


def _foreach_temporaries(optimizer: OptimizerModel, parameter_bytes: int) -> list[tuple[int, int]]:
    """(bytes allocated at its start, bytes freed at its end) for each multi-tensor op of a step:
    the temporaries made by the first of its last ``foreach_temporary_ops`` and freed by its last."""
    memory = [(0, 0)] * optimizer.foreach_ops
    held = round(optimizer.foreach_temporaries * parameter_bytes)
    if held and optimizer.foreach_temporary_ops:
        first = optimizer.foreach_ops - optimizer.foreach_temporary_ops
        memory[first] = (held, memory[first][1])
        memory[-1] = (memory[-1][0], held)
    return memory


def optimizer_in(tg: TaskGraph) -> tuple[list[str], OptimizerModel | None, bool]:
    """A lowered step's optimizer tasks (phase ``"optim"``), the OptimizerModel their op names
    (``optimizer.<name>``; None for none or an unknown name) and whether they launch GPU kernels."""
    optim = tg.select(phase="optim")
    model = OPTIMIZERS.get(tg.task(optim[0]).op.split(".", 1)[-1]) if optim else None
    return optim, model, any(tg.task(n).kind is TaskKind.GPU for n in optim)
