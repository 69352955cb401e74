"""The report's rows for a graph's passes, as the pipeline's choice leaves them.

A row carries the pass's own reason (its judgement, on the costs it saw when it ran) and the
predicted deltas the report adds up; these helpers make a row say what happened after: not
chosen by ``auto``, predicted again after the side-by-side rounds, or not run at all.
"""
from __future__ import annotations

import dataclasses

from fxdream.report import PassReport

# A row's Δ moved by more than this share of its graph's predicted time when predicted again:
# its reason gives the new times beside its own
RETIMED_SHOWN_ABOVE = 0.01


def repredicted(row: PassReport, before: tuple[float, int], after: tuple[float, int]) -> PassReport:
    """``row`` with its predicted deltas from ``before`` and ``after`` ((µs, peak bytes) of the
    graph without and with its rewrite, predicted from the costs as they are now: after the
    side-by-side rounds), so that the rows add up to the report's predicted totals. Where that
    moves its Δ by more than ``RETIMED_SHOWN_ABOVE`` of the graph's time, its reason (the pass's
    own, from its first look at each graph) gains the times re-timed side by side, so the row
    reads the numbers its Δ column and the totals use."""
    (before_us, before_peak), (after_us, after_peak) = before, after
    reason = row.reason
    if row.predicted_delta_us is not None and \
            abs(after_us - before_us - row.predicted_delta_us) > RETIMED_SHOWN_ABOVE * before_us:
        reason += f"; re-timed side by side: {before_us / 1e3:.3f} → {after_us / 1e3:.3f} ms"
    return dataclasses.replace(row, reason=reason, predicted_delta_us=after_us - before_us,
                               predicted_delta_peak_bytes=after_peak - before_peak)


def rows_not_chosen(candidates: dict, best: tuple) -> list[tuple[PassReport, tuple]]:
    """A row for every applicable pass outside the chosen subset, with that subset: what it did
    on its own (the first subset it ran in), or why it did nothing, so no pass vanishes from the
    report. ``candidates``: subset of passes → (its graph, its rows), smaller subsets first."""
    rows = {}
    for subset, (_, subset_rows) in candidates.items():
        if subset and subset[-1] not in best and subset[-1] not in rows:
            row = subset_rows[-1]
            rows[subset[-1]] = (dataclasses.replace(row, applied=False, reason=f"not chosen: {row.reason}")
                                if row.applied else row, subset)
    return list(rows.values())


def not_run(row: PassReport, why: str) -> PassReport:
    """``row``, if applied, as a rewrite whose graph no longer runs (``why``): it runs as captured."""
    if not row.applied:
        return row
    return dataclasses.replace(row, applied=False, reason=f"applied, but {why}; the graph runs as captured: "
                               f"{row.reason}", predicted_delta_us=None, predicted_delta_peak_bytes=None)
