"""A measured cost model read at one end of each op's measured spread: the bounds a prediction's
range is simulated with."""
from __future__ import annotations

import torch.fx as fx

from fxdream.sim.cost.profiled import Profiled
from fxdream.sim.profile.op_keys import profile_key


class SpreadBound:
    """``cost`` read at the fast (``side="low"``) or slow ("high") end of what was measured.

    A graph timed in side-by-side rounds (``Profiled.profile_side_by_side``) has every op scaled
    by its fastest or slowest whole run over the median run (``Profiled.run_spread_of``): a
    machine's noise moves a run's ops together, and ops at their own extremes at once would add
    up to a run no round took (on a small graph, twice its median). Another graph's ops are at
    the fastest or slowest of their in-context samples. An op with no in-context samples (timed
    alone, or not timed) keeps its measured time; everything else (dispatch, graph calls,
    utilization) is ``cost``'s."""

    def __init__(self, cost: Profiled, side: str):
        if side not in ("low", "high"):
            raise ValueError(f"side={side!r}; valid: 'low', 'high'")
        self._cost, self._pick = cost, min if side == "low" else max
        self._side = side
        self._spreads: dict[int, object] = {}  # id(fx.Graph) → its RunSpread or None
        self.device = cost.device

    def kernel_us(self, node: fx.Node) -> float:
        measured = self._cost.kernel_us(node)
        spread = self._run_spread(node.graph)
        if spread is not None:
            return measured * (spread.low if self._side == "low" else spread.high)
        samples = self._cost.samples.get(profile_key(node, self._cost.torch_device.type))
        return self._pick(samples) if samples and measured else measured

    def _run_spread(self, graph: fx.Graph):
        if id(graph) not in self._spreads:
            owner = graph.owning_module
            self._spreads[id(graph)] = None if owner is None else self._cost.run_spread_of(owner)
        return self._spreads[id(graph)]

    def __getattr__(self, name):
        return getattr(self._cost, name)
