"""fxdream.simulate(): capture → (passes) → lower → simulate, for this machine or any DeviceSpec."""
from __future__ import annotations

import dataclasses

import torch

from fxdream.build import cost_model_for
from fxdream.capturing.capture_model import capture_with_host_gaps
from fxdream.plan import plan
from fxdream.sim.cost.profiled import DeviceSpec, Profiled
from fxdream.sim.lower import OPTIMIZERS
from fxdream.sim.prediction import Prediction, predict


def simulate(model: torch.nn.Module, example_inputs=(), device: str | DeviceSpec = "cpu",
             training: bool = False, cost: str = "auto", optimizer: str | None = "sgd",
             contention: bool = True, passes=(), memory_budget: int | None = None,
             example_kwargs: dict | None = None) -> Prediction:
    """Predict one iteration of ``model`` on ``device`` (a DeviceSpec name such as "h100"), called
    with ``example_inputs`` and the keyword inputs ``example_kwargs``.

    Training includes backward and the optimizer step (``optimizer``: "sgd", "adam" or None).
    ``passes`` ("auto" or names) rewrite the captured graphs for ``device`` first (nothing runs
    there: a GPU works from a CPU machine); the rows say what each did (``.passes``).
    """
    if optimizer is not None and optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not known; valid: {', '.join(OPTIMIZERS)} or None")
    model_cost = cost_model_for(device, cost, reuse=True)
    # host time outside the graphs (graph breaks, autograd) is measured here: only for this machine
    captured, step, notes = capture_with_host_gaps(model, example_inputs, training,
                                                   measure=isinstance(model_cost, Profiled),
                                                   example_kwargs=example_kwargs)
    if not passes:
        prediction = predict(captured, model_cost, training, OPTIMIZERS.get(optimizer),
                             contention=contention, step=step)
        return dataclasses.replace(prediction, notes=notes)
    planned = plan(model, captured, device, training, passes, model_cost, memory_budget,
                   OPTIMIZERS.get(optimizer), contention, step=step)
    return dataclasses.replace(planned.after, passes=planned.rows, notes=notes)
