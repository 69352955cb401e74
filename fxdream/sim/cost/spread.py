"""A measured cost model read at one end of each op's measured spread: the bounds a prediction's
range is simulated with."""
from __future__ import annotations

import torch.fx as fx

from fxdream.sim.cost.profiled import Profiled
from fxdream.sim.profile.op_keys import profile_key


class SpreadBound:
    """``cost`` with each op's kernel time at the fastest (``side="low"``) or slowest ("high") of
    its in-context samples: the rounds a build timed differ by the machine's noise and the ops'
    own variation, and a prediction simulated with either end bounds what a run can take. An op
    with no in-context samples (timed alone, or not timed) keeps its measured time; everything
    else (dispatch, graph calls, utilization) is ``cost``'s."""

    def __init__(self, cost: Profiled, side: str):
        if side not in ("low", "high"):
            raise ValueError(f"side={side!r}; valid: 'low', 'high'")
        self._cost, self._pick = cost, min if side == "low" else max
        self.device = cost.device

    def kernel_us(self, node: fx.Node) -> float:
        measured = self._cost.kernel_us(node)
        samples = self._cost.samples.get(profile_key(node, self._cost.torch_device.type))
        return self._pick(samples) if samples and measured else measured

    def __getattr__(self, name):
        return getattr(self._cost, name)
