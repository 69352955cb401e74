"""Timeline export: Chrome trace JSON (Perfetto, chrome://tracing) and matplotlib PNGs.

Chrome trace: process "host" holds one thread track per CPU thread, process "gpu" one per
stream, process "comm" one per channel; every task is a complete ("X") event in µs with its
layer/op/fx_node in ``args``; LAUNCH and GRAPH_LAUNCH edges are flow arrows; memory is a
counter track.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence

from fxdream.sim.simulate import Timeline
from fxdream.sim.taskgraph import DepKind, TaskGraph, TaskKind

_PROCESSES = (("cpu", "host"), ("stream", "gpu"), ("comm", "comm"))
_KIND_COLORS = {TaskKind.CPU: "#4c72b0", TaskKind.GPU: "#55a868", TaskKind.COMM: "#c44e52",
                TaskKind.SYNC: "#8172b2"}


def _resource_key(resource: str):
    """Sort cpu threads, then streams, then channels, by number; unknown prefixes last."""
    prefix, _, num = resource.partition(":")
    order = next((i for i, (p, _) in enumerate(_PROCESSES) if p == prefix), len(_PROCESSES))
    return order, prefix, int(num) if num.isdigit() else 0, resource


def _tracks(graph: TaskGraph) -> dict[str, tuple[int, int]]:
    """resource -> (pid, tid); tids are unique across the whole trace."""
    out = {}
    for tid, r in enumerate(sorted(graph.resources, key=_resource_key), start=1):
        out[r] = (_resource_key(r)[0], tid)
    return out


def to_chrome_trace(graph: TaskGraph, timeline: Timeline) -> dict:
    """Chrome trace event format (JSON object form) of a simulated graph."""
    tracks = _tracks(graph)
    ev: list[dict] = []
    for pid in sorted({p for p, _ in tracks.values()}):
        name = _PROCESSES[pid][1] if pid < len(_PROCESSES) else "other"
        ev.append({"name": "process_name", "ph": "M", "pid": pid, "tid": 0,
                   "args": {"name": name}})
        ev.append({"name": "process_sort_index", "ph": "M", "pid": pid, "tid": 0,
                   "args": {"sort_index": pid}})
    for r, (pid, tid) in tracks.items():
        ev.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid,
                   "args": {"name": r}})
        ev.append({"name": "thread_sort_index", "ph": "M", "pid": pid, "tid": tid,
                   "args": {"sort_index": tid}})
    times = timeline.times
    for t in graph.tasks:
        s, e = times[t.name]
        pid, tid = tracks[t.resource]
        ev.append({"name": t.op or t.name, "cat": t.kind.value, "ph": "X", "ts": s,
                   "dur": e - s, "pid": pid, "tid": tid,
                   "args": {"task": t.name, "layer": t.layer, "op": t.op,
                            "fx_node": t.fx_node, "phase": t.phase}})
    flow = 0
    for src, dst, kind in graph.deps:
        if kind not in (DepKind.LAUNCH, DepKind.GRAPH_LAUNCH):
            continue
        flow += 1
        (ps, ts), (pd, td) = tracks[graph.task(src).resource], tracks[graph.task(dst).resource]
        ev.append({"name": kind.value, "cat": "flow", "ph": "s", "id": flow, "pid": ps,
                   "tid": ts, "ts": times[src][0]})
        ev.append({"name": kind.value, "cat": "flow", "ph": "f", "bp": "e", "id": flow,
                   "pid": pd, "tid": td, "ts": times[dst][0]})
    for tm, b in timeline.memory_curve:
        ev.append({"name": "memory", "ph": "C", "pid": 0, "tid": 0, "ts": tm,
                   "args": {"bytes": b}})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"makespan_us": timeline.makespan_us,
                          "peak_memory_bytes": timeline.peak_memory_bytes}}


def write_chrome_trace(graph: TaskGraph, timeline: Timeline, path) -> str:
    """Write :func:`to_chrome_trace` as JSON to ``path``; returns the path."""
    path = os.fspath(path)
    with open(path, "w") as f:
        json.dump(to_chrome_trace(graph, timeline), f)
    return path


def _figure_api():
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError("plotting timelines needs matplotlib: pip install matplotlib "
                          "(or pip install fxdream[plot])") from e
    return Figure, FigureCanvasAgg


def _color_of(task, color_by: str, layer_colors: dict) -> str:
    if color_by == "layer" and task.layer:
        top = task.layer.split(".")[0]
        if top not in layer_colors:
            palette = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860",
                       "#da8bc3", "#8c8c8c", "#ccb974", "#64b5cd")
            layer_colors[top] = palette[len(layer_colors) % len(palette)]
        return layer_colors[top]
    return _KIND_COLORS[task.kind]


def _draw_rows(ax, graph: TaskGraph, timeline: Timeline, color_by: str) -> None:
    resources = sorted(graph.resources, key=_resource_key)
    row = {r: i for i, r in enumerate(resources)}
    bars: dict[tuple[int, str], list] = {}
    layer_colors: dict = {}
    for t in graph.tasks:
        s, e = timeline.times[t.name]
        bars.setdefault((row[t.resource], _color_of(t, color_by, layer_colors)),
                        []).append((s, max(e - s, 1e-9)))
    for (i, color), spans in bars.items():
        ax.broken_barh(spans, (i - 0.4, 0.8), facecolors=color, edgecolor="none")
    ax.set_yticks(range(len(resources)), resources)
    ax.set_ylim(len(resources) - 0.5, -0.5)
    ax.set_xlim(0, max(timeline.makespan_us, 1e-9))
    if color_by == "layer" and layer_colors:
        from matplotlib.patches import Patch
        ax.legend(handles=[Patch(color=c, label=l) for l, c in list(layer_colors.items())[:12]],
                  fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))


def _fmt_bytes(b: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(b) < 1024 or unit == "GiB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{b:.0f} B"
        b /= 1024
    return f"{b:.1f} GiB"


def _draw_memory(ax, timeline: Timeline, label=None) -> None:
    xs = [t for t, _ in timeline.memory_curve] + [timeline.makespan_us]
    ys = [b / 2 ** 20 for _, b in timeline.memory_curve]
    ys.append(ys[-1])
    ax.step(xs, ys, where="post", label=label)
    ax.set_ylabel("memory (MiB)")


def plot_timeline(graph: TaskGraph, timeline: Timeline, path, title: str | None = None, *,
                  color_by: str = "kind") -> str:
    """PNG: one row per resource (colour by ``"kind"`` or top-level ``"layer"``), memory
    below."""
    Figure, Canvas = _figure_api()
    n = len(graph.resources)
    fig = Figure(figsize=(12, 1.5 + 0.45 * n + 2))
    ax, axm = fig.subplots(2, 1, sharex=True, height_ratios=(max(n, 1), 2.5))
    _draw_rows(ax, graph, timeline, color_by)
    ax.set_title(title or f"makespan {timeline.makespan_us:.1f} µs, "
                 f"peak memory {_fmt_bytes(timeline.peak_memory_bytes)}")
    _draw_memory(axm, timeline)
    axm.set_xlabel("time (µs)")
    fig.tight_layout()
    path = os.fspath(path)
    Canvas(fig).print_png(path)
    return path


def plot_comparison(before: Sequence, after: Sequence, path, *,
                    labels: tuple[str, str] = ("before", "after"), title: str | None = None,
                    color_by: str = "kind") -> str:
    """PNG comparing two ``(graph, timeline)`` pairs on one time axis, memory overlaid."""
    Figure, Canvas = _figure_api()
    pairs = (tuple(before), tuple(after))
    rows = [max(len(g.resources), 1) for g, _ in pairs]
    fig = Figure(figsize=(12, 2 + 0.45 * sum(rows) + 2.5))
    axes = fig.subplots(3, 1, sharex=True, height_ratios=(*rows, 2.5))
    for ax, (g, tl), label in zip(axes, pairs, labels):
        _draw_rows(ax, g, tl, color_by)
        ax.set_title(f"{label}: makespan {tl.makespan_us:.1f} µs, "
                     f"peak memory {_fmt_bytes(tl.peak_memory_bytes)}", fontsize="small")
    for (_, tl), label in zip(pairs, labels):
        _draw_memory(axes[2], tl, label)
    axes[2].legend(fontsize="small")
    axes[2].set_xlabel("time (µs)")
    axes[2].set_xlim(0, max(max(tl.makespan_us for _, tl in pairs), 1e-9))
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = os.fspath(path)
    Canvas(fig).print_png(path)
    return path
