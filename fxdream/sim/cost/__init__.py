"""Cost models: how long one node takes on the host and as a kernel, for a DeviceSpec."""
from fxdream.sim.cost.analytic import Analytic
from fxdream.sim.cost.devices import DEVICES, DeviceSpec, get_device
from fxdream.sim.cost.model import CostModel
from fxdream.sim.cost.profiled import Profiled

__all__ = ["CostModel", "Analytic", "Profiled", "DeviceSpec", "DEVICES", "get_device"]
