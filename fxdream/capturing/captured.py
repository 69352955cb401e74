"""What a capture holds: per dynamo subgraph, its ATen forward (and backward) graphs."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.fx as fx

from fxdream.ir.flops import node_flops
from fxdream.ir.nodes import LAYER, ROOT_LAYER_LABEL, is_compute


class CaptureError(RuntimeError):
    """Nothing could be captured; the message says why."""


@dataclass(frozen=True)
class LayerStats:
    layer: str
    forward_ops: int
    backward_ops: int
    forward_flops: int
    backward_flops: int


@dataclass(frozen=True)
class Captured:
    """One dynamo subgraph: its ATen forward and (in training) backward graphs.

    ``forward``/``backward`` are the graphs as captured (before any pass); every
    compute node has ``meta["layer"]`` and ``meta["val"]`` (a fake tensor).
    """
    index: int
    forward: fx.GraphModule
    backward: fx.GraphModule | None
    torch_graph: fx.GraphModule
    training: bool
    input_shapes: tuple
    unmapped_backward_nodes: int = 0
    # the real tensors the forward graph received at capture (parameters, buffers, inputs):
    # what in-context profiling runs the graphs on
    example_inputs: tuple = field(default=(), repr=False, compare=False)
    # positions in ``example_inputs`` that hold the model's parameters or buffers
    state_positions: frozenset = frozenset()

    def graphs(self) -> tuple[tuple[str, fx.GraphModule], ...]:
        pairs = [("fw", self.forward)]
        if self.backward is not None:
            pairs.append(("bw", self.backward))
        return tuple(pairs)

    def layers(self) -> tuple[LayerStats, ...]:
        """Per layer, in forward order: op counts and FLOPs of forward and backward."""
        order: dict[str, list[int]] = {}
        for phase, gm in self.graphs():
            offset = 0 if phase == "fw" else 1
            for node in gm.graph.nodes:
                if not is_compute(node):
                    continue
                row = order.setdefault(node.meta.get(LAYER, ""), [0, 0, 0, 0])
                row[offset] += 1
                row[2 + offset] += node_flops(node)
        return tuple(LayerStats(layer, *row) for layer, row in order.items())

    def total_flops(self) -> int:
        return sum(s.forward_flops + s.backward_flops for s in self.layers())

    def summary(self, top: int | None = None) -> str:
        """A table of layers (op counts, GFLOPs); ``top`` keeps the costliest N."""
        rows = list(self.layers())
        if top is not None:
            rows = sorted(rows, key=lambda s: -(s.forward_flops + s.backward_flops))[:top]
        head = f"subgraph {self.index}: {len(self.layers())} layers, " \
               f"{_count_compute(self.forward)} fw ops" + \
               (f", {_count_compute(self.backward)} bw ops" if self.backward is not None else "") + \
               f", {self.total_flops() / 1e9:.3f} GFLOP"
        width = max([len(ROOT_LAYER_LABEL)] + [len(r.layer) for r in rows])
        lines = [head, f"{'layer':<{width}}  {'fw ops':>6}  {'bw ops':>6}  {'fw GFLOP':>9}  {'bw GFLOP':>9}"]
        for r in rows:
            lines.append(f"{r.layer or ROOT_LAYER_LABEL:<{width}}  {r.forward_ops:>6}  {r.backward_ops:>6}"
                         f"  {r.forward_flops / 1e9:>9.4f}  {r.backward_flops / 1e9:>9.4f}")
        return "\n".join(lines)


def captured_parts(captured) -> tuple:
    """A capture as a tuple of ``Captured``: one, several after graph breaks, or none (None)."""
    if captured is None:
        return ()
    return captured if isinstance(captured, tuple) else (captured,)


def _count_compute(gm: fx.GraphModule) -> int:
    return sum(is_compute(n) for n in gm.graph.nodes)


