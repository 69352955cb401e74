"""benchmarks/ddp_gloo.py: its all-reduce fit by hand, and real DDP over gloo in two processes."""
import importlib
import math
import sys
from pathlib import Path

import pytest


def _ddp_gloo_module():
    """benchmarks/ddp_gloo.py (imports only torch at module level: spawned workers start fast)."""
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)  # spawned children inherit sys.path and import it by name
    return importlib.import_module("ddp_gloo")


def test_gloo_allreduce_fit():
    fit = _ddp_gloo_module().fit_allreduce
    sizes = [1e6, 2e6, 4e6]
    times_ms = [(2 * 50 + s / 1e9 * 1e6) / 1e3 for s in sizes]   # n=2: S/B + 2α, B=1 GB/s, α=50 µs
    bandwidth, latency = fit(sizes, times_ms, 2)
    assert bandwidth == pytest.approx(1e9) and latency == pytest.approx(50.0)
    assert fit(sizes, [1.0, 1.0, 1.0], 2) == (math.inf, 500.0)   # flat: latency-bound


def test_gloo_ddp_smoke_two_processes():
    """Real DistributedDataParallel over gloo, 2 spawned processes on this machine (the
    prediction is left to benchmarks/ddp_gloo.py: capturing in both children is slow)."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    bench = _ddp_gloo_module()
    run = bench.GlooRun(layers=(32, 64, 8), batch=4, rounds=2, block=2, predict=False,
                        sizes_bytes=(16 * 1024, 64 * 1024), timeout_s=60,
                        start_method="forkserver")
    try:
        out = bench.measure_ddp_gloo(run)
    except (RuntimeError, OSError) as e:
        if "timed out" in str(e) or isinstance(e, OSError):
            pytest.skip(f"could not run 2 gloo processes here: {e}")
        raise
    assert out["measured_ddp_ms"] > 0 and out["measured_local_ms"] > 0
    assert out["gloo_bandwidth_GBps"] > 0 and out["gloo_latency_us"] >= 0
    assert len(out["ranks"]) == 2 and out["ddp_bucket_MB"] in (None, [round(out["gradient_MB"], 3)])
    assert out["gradient_MB"] == pytest.approx((32 * 64 + 64 + 64 * 8 + 8) * 4 / 1e6)
