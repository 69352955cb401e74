"""How far a graph's next run may fall from the median of the runs timed side by side.

The fastest and slowest of n runs bound only part of what the next runs do: of n runs, a further
run falls between their minimum and maximum with probability (n - 1) / (n + 1), 33 % for the
2 runs and 67 % for the 5 runs a build times. A range meant to hold the runs a user will see
is a prediction interval instead: were run times normal, a further run falls within
z·σ·√(1 + 1/n) of the mean with the probability z stands for, and the range of n runs estimates
σ as (max - min) / d₂(n). Each side is scaled from the measured one (median - min, max -
median): timing noise is skewed (a run is slowed far more often than sped up), and the scaling
keeps that shape.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

COVERAGE_Z = 1.645  # a two-sided 90 % interval: margin over the 80 % a range must hold
# d₂(n): the expected range of n samples from a normal distribution, in standard deviations
# (the statistical process control table), for up to 10 runs
D2 = {2: 1.128, 3: 1.693, 4: 2.059, 5: 2.326, 6: 2.534, 7: 2.704, 8: 2.847, 9: 2.970, 10: 3.078}
# Beyond 10 runs σ comes from the quartiles (a normal distribution's lie 0.6745 σ from its
# median): the extremes of many short steps hold a garbage collection or a page-fault storm
# that no median of further steps sees (one GNMT step in 20 took over 3x their median)
QUARTILE_SIGMAS = 0.6745


@dataclass(frozen=True)
class RunSpread:
    """How a graph's whole runs spread over side-by-side rounds: its ops' keys, and the bounds
    a further run is predicted within, over the median run (``low`` ≤ 1 ≤ ``high``);
    ``page_faults_per_run``: the process's page faults in its median run, where counted."""
    keys: frozenset
    low: float
    high: float
    page_faults_per_run: float | None = None

    @classmethod
    def of_runs(cls, keys: frozenset, totals: list[float], faults: list[int] | None = None) -> "RunSpread | None":
        """The prediction interval of ``totals`` (µs of each run, with the page faults of each in
        ``faults``); None without a positive median."""
        middle = statistics.median(totals) if totals else 0.0
        if middle <= 0:
            return None
        page_faults = statistics.median(faults) if faults else None
        if len(totals) < 2:
            return cls(keys, 1.0, 1.0, page_faults)
        n = len(totals)
        if n in D2:
            widen = 2 * COVERAGE_Z * math.sqrt(1 + 1 / n) / D2[n]
            below, above = middle - min(totals), max(totals) - middle
        else:
            widen = COVERAGE_Z * math.sqrt(1 + 1 / n) / QUARTILE_SIGMAS
            first, _, third = statistics.quantiles(totals, n=4)
            below, above = middle - first, third - middle
        low = 1 - widen * below / middle
        high = 1 + widen * above / middle
        return cls(keys, max(low, 0.05), high, page_faults)
