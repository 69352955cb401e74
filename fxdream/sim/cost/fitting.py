"""Fit a DeviceSpec's overheads and roofline shares to measured times.

``fit_parameters`` adjusts the named ``FITTABLE`` parameters so that ``evaluate(spec)`` (the
simulator's predicted ms of each measured case) matches the measured ms: it minimises the sum
of squared log-ratios (every case weighs by its relative error, whatever its size) by a
pattern search in log space (each parameter scaled up and down by a step that halves when no
move helps; a sweep that helped is repeated as one move, Hooke and Jeeves). The simulator is
piecewise linear in these parameters (host-bound cases follow the overheads, device-bound ones
the floor and shares), so a derivative-free search is the robust choice, and a handful of
parameters needs a few hundred evaluations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from fxdream.sim.cost.devices import FITTABLE, DeviceSpec, parameters_of, with_parameters

Evaluate = Callable[[DeviceSpec], Sequence[float]]


@dataclass(frozen=True)
class FitResult:
    parameters: Mapping[str, float]
    predicted_ms: tuple[float, ...]   # each case, with the fitted parameters
    measured_ms: tuple[float, ...]
    evaluations: int

    @property
    def errors_pct(self) -> tuple[float, ...]:
        return tuple(100 * (p / m - 1) for p, m in zip(self.predicted_ms, self.measured_ms))


def log_error(predicted: Sequence[float], measured: Sequence[float], weights: Sequence[float] | None = None) -> float:
    """Sum of squared log-ratios predicted/measured, each times its weight (default 1)."""
    weights = weights or [1.0] * len(measured)
    return sum(w * math.log(max(p, 1e-12) / m) ** 2 for p, m, w in zip(predicted, measured, weights))


def fit_parameters(base: DeviceSpec, names: Sequence[str], evaluate: Evaluate, measured: Sequence[float], *,
                   weights: Sequence[float] | None = None, start_step: float = 1.0, min_step: float = 0.01,
                   max_evaluations: int = 600, progress: Callable[[int, float], None] | None = None) -> FitResult:
    """Fit ``names`` of ``base`` so ``evaluate(spec)`` matches ``measured`` (ms, one per case;
    ``weights``: how much each case counts, e.g. so that many per-op cases weigh as much as a
    few whole-model ones).

    Starts from ``base``'s values (1.0 for one at 0); a share stays in (0, 1]. ``progress(evaluations, error)``
    is called after each improvement."""
    if not measured or any(m <= 0 for m in measured):
        raise ValueError(f"measured times must be positive and not empty, got {list(measured)}")
    if weights is not None and len(weights) != len(measured):
        raise ValueError(f"{len(weights)} weights for {len(measured)} measured cases")
    unknown = sorted(set(names) - set(FITTABLE))
    if unknown or not names:
        raise ValueError(f"parameters to fit must be among {', '.join(FITTABLE)}; got {list(names)}")
    # a parameter at 0 starts at 1: a log-space search cannot leave 0
    values = {n: v if v > 0 else 1.0 for n, v in parameters_of(base, names).items()}
    evaluations = 0

    def error_of(candidate: Mapping[str, float]) -> float:
        nonlocal evaluations
        evaluations += 1
        predicted = evaluate(with_parameters(base, candidate))
        if len(predicted) != len(measured):
            raise ValueError(f"evaluate returned {len(predicted)} times for {len(measured)} measured cases")
        return log_error(predicted, measured, weights)

    best, step = error_of(values), start_step

    def try_move(trial: dict[str, float]) -> bool:
        nonlocal best, values
        trial = {n: min(v, 1.0) if n.startswith("roofline_share.") else v for n, v in trial.items()}
        if trial == values:
            return False
        error = error_of(trial)
        if error >= best:
            return False
        best, values = error, trial
        if progress is not None:
            progress(evaluations, best)
        return True

    while step >= min_step and evaluations < max_evaluations:
        start = dict(values)
        for name in names:
            for direction in (step, -step):
                if try_move({**values, name: values[name] * math.exp(direction)}):
                    break
        if values == start:
            step /= 2
            continue
        # Hooke-Jeeves pattern move: repeat the sweep's displacement while it helps (a valley
        # along two correlated parameters is followed in a few moves, not many small steps)
        while evaluations < max_evaluations:
            before = dict(values)
            if not try_move({n: values[n] * values[n] / start[n] for n in names}):
                break
            start = before
    predicted = tuple(float(t) for t in evaluate(with_parameters(base, values)))
    return FitResult(dict(values), predicted, tuple(float(m) for m in measured), evaluations)
