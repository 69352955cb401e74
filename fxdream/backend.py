"""``torch.compile(model, backend="fxdream", options={...})``.

Registered through the ``torch_dynamo_backends`` entry point (setup.cfg), so the name
works once fxdream is installed. Options: ``passes`` (names, a comma-separated string or
"auto"), ``device`` ("cpu" | "cuda"), ``cost`` ("auto" | "profiled" | "analytic" | None),
``on_report`` (a callable receiving each PassReport row as it is made). For the full report and
the eager fallback, use ``fxdream.optimize``, which builds on the same backend.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.fx as fx

from fxdream.build import check_cost, cost_model_for
from fxdream.capturing.arguments import parse_device
from fxdream.capturing.gc_freeze import older_objects_frozen
from fxdream.capturing.session import CaptureSession
from fxdream.pass_api import PassContext
from fxdream.pass_registry import resolve_passes
from fxdream.pass_runner import PassPipeline
from fxdream.sim.prediction import this_machine_device
from fxdream.sim.profile.store import save_profile

OPTIONS = ("passes", "device", "cost", "on_report")


def fxdream_backend(gm: fx.GraphModule, example_inputs: Sequence, options: dict | None = None,
                    mode: str | None = None) -> Callable:
    """A dynamo backend: aot_autograd into ATen graphs, then fxdream's passes."""
    if mode is not None:  # torch.compile passes its ``mode`` on to the backend
        raise ValueError(f"mode={mode!r} is inductor's; fxdream takes options={{'passes': ...}} (see "
                         f"README, torch.compile), e.g. options={{'passes': 'auto'}} or ['cuda_graphs']")
    options = dict(options or {})
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(f"unknown fxdream option(s) {unknown}; valid options: {', '.join(OPTIONS)}")
    passes = resolve_passes(options.get("passes", ()))
    cost = options.get("cost", "auto")
    check_cost(cost)
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    device = _device(options.get("device"), tensors)
    training = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    cost_model = cost_model_for(this_machine_device(device), cost, reuse=True) if passes and cost else None
    pipeline = PassPipeline(passes, PassContext(device=device.type, training=training, cost_model=cost_model),
                            auto=options.get("passes") == "auto", on_row=options.get("on_report"))
    with older_objects_frozen():
        compiled = CaptureSession(None, transform=pipeline if passes else None)(gm, example_inputs)
    save_profile(cost_model)  # for a later process ($FXDREAM_PROFILE_DIR)
    return compiled


def _device(asked, tensors: list) -> torch.device:
    """The ``device`` option, or the first input's device (the CPU without one)."""
    if not asked:
        return tensors[0].device if tensors else torch.device("cpu")
    return parse_device(asked)
