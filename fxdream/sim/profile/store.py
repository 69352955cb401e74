"""Measured costs kept for the rest of the process, and on disk with ``FXDREAM_PROFILE_DIR``.

A build spends most of its time timing graphs in context.
A rebuild (after a weight change, for an A/B baseline, at a batch size seen before, in a new
process with the directory set) meets the same op+shape keys, so it reuses their times
instead of running the graphs again. Times depend on the device, the torch build and the
number of threads, so each combination has its own store. ``forget_profiles()`` drops them
all (the machine's load changed, say), and the next build measures afresh.
"""
from __future__ import annotations

import json
import os
import tempfile
import warnings
from pathlib import Path

import torch

from fxdream.sim.cost.devices import DeviceSpec
from fxdream.sim.cost.profiled import Profiled
from fxdream.sim.profile.host_timing import ModuleBuilder, as_graph_module

PROFILE_DIR_ENV = "FXDREAM_PROFILE_DIR"
MAX_SAMPLES_KEPT = 25  # per key on disk: the latest, enough for a stable median

# store key → (measurements, in-context samples, whole runs' spreads); the spreads stay in the process
_STORES: dict[tuple, tuple[dict, dict, list]] = {}


def shared_profile(device: DeviceSpec, torch_device: str | torch.device,
                   build_module: ModuleBuilder = as_graph_module, context_rounds: int | None = None) -> Profiled:
    """A ``Profiled`` cost model whose measurements are this process's store for the device."""
    key = _store_key(device, torch.device(torch_device))
    if key not in _STORES:
        _STORES[key] = _load(key)
    cost = Profiled(device, torch_device, build_module=build_module, context_rounds=context_rounds)
    cost.measurements, cost.samples, cost.run_spreads = _STORES[key]
    return cost


def save_profile(cost) -> Path | None:
    """Write ``cost``'s store to ``$FXDREAM_PROFILE_DIR`` (atomically); None when it is not set
    or ``cost`` measures nothing (None, analytic)."""
    if not isinstance(cost, Profiled):
        return None
    path = _store_path(_store_key(cost.device, cost.torch_device))
    if path is None:
        return None
    samples = {k: v[-MAX_SAMPLES_KEPT:] for k, v in cost.samples.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump({"measurements_us": cost.measurements, "samples_us": samples}, f)
    os.replace(f.name, path)
    return path


def forget_profiles() -> None:
    """Drop every store of this process (files on disk stay; delete them to re-measure there too)."""
    _STORES.clear()


def _store_key(device: DeviceSpec, torch_device: torch.device) -> tuple:
    return device.name, torch_device.type, torch.__version__, torch.get_num_threads()


def _store_path(key: tuple) -> Path | None:
    directory = os.environ.get(PROFILE_DIR_ENV)
    if not directory:
        return None
    name, kind, version, threads = key
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in f"{name}-{kind}-torch{version}-{threads}t")
    return Path(directory) / f"{safe}.json"


def _load(key: tuple) -> tuple[dict, dict, list]:
    path = _store_path(key)
    if path is None or not path.exists():
        return {}, {}, []
    try:
        data = json.loads(path.read_text())
        measurements = {str(k): float(v) for k, v in data["measurements_us"].items()}
        samples = {str(k): [float(x) for x in v] for k, v in data["samples_us"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        warnings.warn(f"ignoring the profile store {path} ({error}); measuring afresh", RuntimeWarning)
        return {}, {}, []
    return measurements, samples, []
