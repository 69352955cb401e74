"""Whether other processes ran beside a measurement: timings taken while they did describe a
busy machine, and the decisions made on them are marked (Linux: /proc; elsewhere unknown)."""
from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass

# Other processes' CPU time per second of measuring above which the measurements are disturbed:
# a quarter of a core already moves a timing on a machine with few cores
DISTURBED_CORES = 0.25


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


@dataclass
class LoadWatch:
    """Other processes' CPU seconds over a window (None where /proc cannot tell), once closed."""
    foreign_cpu_s: float | None = None
    window_s: float = 0.0

    @property
    def cores(self) -> float | None:
        """Other processes' CPU time per second of the window: how many cores they kept busy."""
        if self.foreign_cpu_s is None or self.window_s <= 0:
            return None
        return self.foreign_cpu_s / self.window_s

    @property
    def disturbed(self) -> bool:
        return self.cores is not None and self.cores > DISTURBED_CORES

    def describe(self, what: str = "build") -> str:
        return (f"other processes kept {self.cores:.2f} core(s) busy while this {what} measured "
                f"({self.foreign_cpu_s:.2f} CPU-s over {self.window_s:.2f} s)")


@contextlib.contextmanager
def watch_machine_load():
    """A ``LoadWatch`` of the body, filled in when it ends."""
    watch = LoadWatch()
    try:
        before, started = cpu_ticks(), time.perf_counter()
    except OSError:
        yield watch
        return
    try:
        yield watch
    finally:
        try:
            watch.foreign_cpu_s = foreign_cpu_seconds(before, cpu_ticks())
            watch.window_s = time.perf_counter() - started
        except OSError:
            pass
