"""Immutable reports: what was captured, what each pass did, predicted and measured effects."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from fxdream.capturing.captured import Captured, _count_compute
from fxdream.numerics import Deviation

MEASURED_SLOWER = "measured slower than eager"  # the eager check's fallback reason starts so


@dataclass(frozen=True)
class GraphReport:
    """One captured dynamo subgraph."""
    index: int
    input_shapes: tuple
    forward_ops: int
    backward_ops: int | None
    layers: int
    gflops: float
    unmapped_backward_nodes: int

    @classmethod
    def of(cls, captured: Captured) -> "GraphReport":
        return cls(captured.index, captured.input_shapes, _count_compute(captured.forward),
                   None if captured.backward is None else _count_compute(captured.backward),
                   len(captured.layers()), captured.total_flops() / 1e9,
                   captured.unmapped_backward_nodes)


@dataclass(frozen=True)
class PassReport:
    """One pass on one graph: applied or why not, and its predicted (and measured) effect."""
    name: str
    graph_index: int
    phase: str
    applied: bool
    reason: str
    notes: tuple = ()
    predicted_delta_us: float | None = None
    predicted_delta_peak_bytes: int | None = None
    measured_delta_us: float | None = None


@dataclass(frozen=True)
class Report:
    model: str
    training: bool
    device: str
    graphs: tuple[GraphReport, ...]
    graph_breaks: tuple[str, ...] = ()
    fallback_reason: str | None = None
    passes: tuple[PassReport, ...] = ()
    build_seconds: float = 0.0
    capture: str = "dynamo"                       # how the graphs were captured (and why not by torch.fx)
    notes: tuple[str, ...] = field(default=())
    predicted_baseline_ms: float | None = None    # predicted: the capture without passes
    predicted_optimized_ms: float | None = None   # predicted: with the passes applied
    # predicted (low, high) ms of each: every op at the fastest / slowest of its measured samples
    predicted_baseline_ms_range: tuple[float, float] | None = None
    predicted_optimized_ms_range: tuple[float, float] | None = None
    predicted_peak_delta_bytes: int | None = None
    top_layers: tuple = ()                        # predicted (layer, ms) with the passes, costliest first
    verified_max_abs_diff: float | None = None    # verify=True: vs eager, outputs (and grads)
    verified_beyond_rounding: bool = False        # ... by more than rounding (build.beyond_rounding)
    precision: str = "fp32"                       # "bf16": optimize(precision="bf16")
    precision_deviation: Deviation | None = None  # measured: the outputs against float32 eager's
    measured_baseline_ms: float | None = None     # measure=True: median ms per call, interleaved
    measured_optimized_ms: float | None = None
    measured_page_faults_per_call: float | None = None  # measure=True: the optimized module's (host pages)
    measured_eager_ms: float | None = None        # eager_check: eager and the built module, interleaved
    measured_built_ms: float | None = None
    measurements_disturbed: str | None = None     # why the build's measurements describe a busy machine

    @property
    def predicted_speedup(self) -> float | None:
        """Predicted baseline time over optimized time (the passes' predicted gain)."""
        if self.predicted_baseline_ms is None or not self.predicted_optimized_ms:
            return None
        return self.predicted_baseline_ms / self.predicted_optimized_ms

    @property
    def predicted_speedup_range(self) -> tuple[float, float] | None:
        """(low, high) of the predicted gain: the slowest optimized against the fastest baseline,
        and the other way round (the widest the two ranges allow); exactly 1 where no pass
        rewrote anything, as both sides are then the same graphs."""
        base, optimized = self.predicted_baseline_ms_range, self.predicted_optimized_ms_range
        if base is None or optimized is None or not optimized[0] or not optimized[1]:
            return None
        if not any(p.applied for p in self.passes) and base == optimized:
            return 1.0, 1.0
        return base[0] / optimized[1], base[1] / optimized[0]

    @property
    def ran_eagerly(self) -> bool:
        return self.fallback_reason is not None

    @property
    def ran_eagerly_as_measured_slower(self) -> bool:
        """Whether the eager check (not a later call) sent the module to eager."""
        return (self.fallback_reason or "").startswith(MEASURED_SLOWER)

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def __str__(self) -> str:
        """What ``print(report)`` shows: the markdown page, not the dataclass's field dump."""
        return self.to_markdown()

    def to_markdown(self) -> str:
        mode = "training" if self.training else "inference"
        lines = [f"## fxdream report: {self.model} ({mode}, {self.device})", ""]
        if self.fallback_reason:
            lines += [f"**Runs eagerly**: {self.fallback_reason}", ""]
        if self.measurements_disturbed:
            lines += [f"**Measurements disturbed**: {self.measurements_disturbed}; the passes' choices and the "
                      f"predictions below were made on them (marked): rebuild on a quiet machine", ""]
        later = " (the build's; later calls of other kinds by dynamo)" \
            if len(self.graphs) > 1 and self.capture.startswith("torch.fx") else ""
        lines.append(f"Captured {len(self.graphs)} subgraph(s) by {self.capture}{later}; "
                     f"built in {self.build_seconds:.2f} s.")
        if self.graph_breaks:
            lines += ["", f"Graph breaks ({len(self.graph_breaks)}):"]
            lines += [f"- {reason}" for reason in self.graph_breaks]
        if self.graphs:
            lines += ["", "| subgraph | input shapes | fw ops | bw ops | layers | GFLOP |",
                      "|---|---|---|---|---|---|"]
            for g in self.graphs:
                shapes = ", ".join(str(s) for s in g.input_shapes[:3]) + (" …" if len(g.input_shapes) > 3 else "")
                bw = "–" if g.backward_ops is None else str(g.backward_ops)
                lines.append(f"| {g.index} | {shapes} | {g.forward_ops} | {bw} | {g.layers} | {g.gflops:.3f} |")
        if self.passes:
            lines += ["", "| pass | graph | applied | reason | predicted Δ µs | predicted Δ peak MB | measured Δ µs |",
                      "|---|---|---|---|---|---|---|"]
            # the module running eagerly runs none of the rewritten graphs, so an applied pass is unused
            applied = "yes, unused (runs eagerly)" if self.fallback_reason else "yes"
            for p in self.passes:
                lines.append(f"| {p.name} | {p.graph_index}/{p.phase} | {applied if p.applied else 'no'} | {p.reason} "
                             f"| {_fmt(p.predicted_delta_us)} | {_fmt_mb(p.predicted_delta_peak_bytes)} "
                             f"| {_fmt(p.measured_delta_us)} |")
            lines += _pass_notes(self.passes)
        if self.predicted_baseline_ms is not None:
            gain = self.predicted_speedup_range
            lines += ["", f"Predicted: {self.predicted_baseline_ms:.3f} ms{_range(self.predicted_baseline_ms_range)} "
                      f"without passes → {self.predicted_optimized_ms:.3f} ms"
                      f"{_range(self.predicted_optimized_ms_range)} with them "
                      f"({_pct(self.predicted_optimized_ms, self.predicted_baseline_ms)}"
                      + (f"; {self.predicted_speedup:.2f}x ({gain[0]:.2f}–{gain[1]:.2f})" if gain else "")
                      + f"), peak memory {_fmt_mb(self.predicted_peak_delta_bytes)} MB."]
        if self.measured_baseline_ms is not None:
            lines.append(f"Measured: {self.measured_baseline_ms:.3f} ms → {self.measured_optimized_ms:.3f} ms "
                         f"({_pct(self.measured_optimized_ms, self.measured_baseline_ms)}).")
        if self.measured_eager_ms is not None:
            lines.append(f"Timed against eager: {self.measured_eager_ms:.3f} ms eager, "
                         f"{self.measured_built_ms:.3f} ms built "
                         f"({_pct(self.measured_built_ms, self.measured_eager_ms)}"
                         f"{'; runs eagerly' if self.ran_eagerly_as_measured_slower else ''}).")
        if self.verified_max_abs_diff is not None:
            flag = " **More than rounding: the module does not compute what eager does (see the notes).**" \
                if self.verified_beyond_rounding else ""
            lines.append(f"Verified against eager: max abs diff {self.verified_max_abs_diff:.2e}.{flag}")
        if self.precision_deviation is not None:
            lines.append(f"Precision {self.precision}: measured against float32 eager on the example inputs: "
                         f"{self.precision_deviation.describe()}.")
        if self.top_layers:
            lines += ["", "| layer (predicted) | ms |", "|---|---|"]
            lines += [f"| {layer or '(model)'} | {ms:.3f} |" for layer, ms in self.top_layers]
        if self.notes:
            lines += [""] + [f"- {n}" for n in self.notes]
        return "\n".join(lines)


def _pass_notes(passes, shown: int = 5) -> list[str]:
    """The passes' notes (where they acted, what differs from eager), a few per pass and graph;
    ``to_json`` has them all."""
    lines = []
    for p in passes:
        notes = [str(n) for n in p.notes]
        if notes:
            more = f" … and {len(notes) - shown} more" if len(notes) > shown else ""
            lines.append(f"- {p.name} ({p.graph_index}/{p.phase}): {'; '.join(notes[:shown])}{more}")
    return ["", "Notes from the passes:"] + lines if lines else []


def _range(bounds: tuple[float, float] | None) -> str:
    return "" if bounds is None else f" ({bounds[0]:.3f}–{bounds[1]:.3f})"


def _pct(new: float, old: float) -> str:
    return f"{100 * (new / old - 1):+.1f} %" if old else "–"


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:+.1f}"


def _fmt_mb(value: int | None) -> str:
    return "–" if value is None else f"{value / 2**20:+.2f}"
