"""How busy this machine is around a measurement (Linux /proc): timings on a shared VM mean
little while other work runs, so benchmarks record it and can wait for a quiet moment."""
from __future__ import annotations

import os
import time


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


def cpu_ticks() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, user + system clock ticks) of every process (/proc; Linux)."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            out[int(entry)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
        except (OSError, IndexError, ValueError):
            continue
    return out


def foreign_cpu_seconds(before: dict, after: dict) -> float:
    """CPU seconds used between two ``cpu_ticks`` snapshots by processes outside this one's
    tree: other people's work that ran beside the measurement."""
    mine, changed = {os.getpid()}, True
    while changed:
        changed = False
        for pid, (ppid, _) in after.items():
            if ppid in mine and pid not in mine:
                mine.add(pid)
                changed = True
    ticks = sum(t - before.get(pid, (0, 0))[1] for pid, (_, t) in after.items() if pid not in mine)
    return max(ticks, 0) / os.sysconf("SC_CLK_TCK")


def wait_until_quiet(max_seconds: float, threshold_pct: float = 15.0) -> float | None:
    """Wait (up to ``max_seconds``) for a second in which the CPU is mostly idle: timings on a
    shared machine mean little while other work runs. Returns the last busy % seen."""
    deadline = time.monotonic() + max_seconds
    busy = cpu_busy_pct()
    while busy is not None and busy > threshold_pct and time.monotonic() < deadline:
        time.sleep(5)
        busy = cpu_busy_pct()
    return busy
