"""The interface every cost model implements: a node's kernel time, its dispatch, a graph call."""
from __future__ import annotations

from typing import Protocol

import torch.fx as fx

from fxdream.sim.cost.devices import DeviceSpec


class CostModel(Protocol):
    device: DeviceSpec

    def kernel_us(self, node: fx.Node) -> float:
        """Device time of the node's kernel (0 for views and metadata ops)."""

    def dispatch_us(self, node: fx.Node) -> float:
        """Host time to dispatch (and on a GPU, launch) the node."""

    def graph_call_us(self) -> float:
        """Host time to enter one compiled graph (dynamo guards, aot wrappers, boxing)."""
