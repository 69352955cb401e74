"""How busy this machine is around a measurement (Linux /proc): timings on a shared VM mean
little while other work runs, so benchmarks record it and can wait for a quiet moment."""
from __future__ import annotations

import time

from fxdream.sim.profile.machine_load import cpu_ticks, foreign_cpu_seconds  # noqa: F401  (benchmarks import them here)


def cpu_busy_pct(seconds: float = 1.0) -> float | None:
    """Share of this machine's CPU time that was busy over ``seconds`` (/proc/stat; Linux)."""
    def sample():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]
    try:
        t0, i0 = sample()
        time.sleep(seconds)
        t1, i1 = sample()
    except OSError:
        return None
    return 100.0 * (1 - (i1 - i0) / max(t1 - t0, 1))


def wait_until_quiet(max_seconds: float, threshold_pct: float = 15.0) -> float | None:
    """Wait (up to ``max_seconds``) for a second in which the CPU is mostly idle: timings on a
    shared machine mean little while other work runs. Returns the last busy % seen."""
    deadline = time.monotonic() + max_seconds
    busy = cpu_busy_pct()
    while busy is not None and busy > threshold_pct and time.monotonic() < deadline:
        time.sleep(5)
        busy = cpu_busy_pct()
    return busy
