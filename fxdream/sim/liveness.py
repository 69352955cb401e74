"""Which allocation each value of the lowered graphs lives in, across forward and backward, and
when each is last used: the allocations and frees the simulated timeline carries."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from fxdream.ir.aliasing import aliases_input
from fxdream.ir.nodes import is_view
from fxdream.ir.tensors import tensor_bytes


class Buffers:
    """Tracks which allocation each value lives in, across fw and bw graphs, for liveness."""

    def __init__(self):
        self.scope = ""                           # subgraph label prefix: "g0" for g0.fw and g0.bw
        self.root: dict[str, tuple] = {}          # scoped value name → buffer id
        self.size: dict[tuple, int] = {}
        self.last_use: dict[tuple, tuple[int, str]] = {}  # buffer → (graph index, task name)
        self.output_graph: dict[tuple, int] = {}
        self.pooled: set[tuple] = set()           # in a CUDA graph's pool: never freed
        self.held: set[tuple] = set()             # returned to the forward's caller: alive to the step's end

    def key(self, node: fx.Node) -> str:
        return f"{self.scope}/{node.name}"

    def known(self, node: fx.Node) -> bool:
        return self.key(node) in self.root

    def define(self, node: fx.Node) -> list[tuple]:
        """Record the buffers ``node`` allocates (returns them) or aliases."""
        key = self.key(node)
        if node.op == "placeholder":
            self.root.setdefault(key, ("input", key))
            return []
        if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
            base = self.root.get(self.key(node.args[0]))
            if base is not None and base[0] == "multi":  # one output, or a list of them (nested)
                leaf = ("buf", *base[1:], node.args[1])
                base = leaf if leaf in self.size else ("multi", *base[1:], node.args[1])
            self.root[key] = base
            return []
        if is_view(node) or aliases_input(node):
            first = next((a for a in node.all_input_nodes), None)
            self.root[key] = self.root.get(self.key(first)) if first is not None else ("input", key)
            return []
        value = node.meta.get("val")
        if isinstance(value, (tuple, list)):  # one buffer per tensor, by its index path
            created = []
            for path, tensor in _tensor_leaves(value):
                created.append(("buf", key, *path))
                self.size[created[-1]] = tensor_bytes(tensor)
            self.root[key] = ("multi", key)
        else:
            created = [("buf", key)]
            self.size[("buf", key)] = tensor_bytes(value)
            self.root[key] = ("buf", key)
        return created

    def use(self, node: fx.Node, task: str, graph_index: int) -> None:
        for arg in node.all_input_nodes:
            for buffer in self._buffers_of(arg):
                self.last_use[buffer] = (graph_index, task)

    def output(self, node: fx.Node, graph_index: int, saved: int | None = None) -> None:
        """``node``'s graph outputs leave it. ``saved``: of a forward's outputs, how many a
        backward reads (the last ones, as aot_autograd orders them); those before go to the
        caller, which holds them until the step ends. None (no backward): none is held here."""
        values = [a for a in tree_flatten(node.args)[0] if isinstance(a, fx.Node)]
        returned = 0 if saved is None else len(values) - saved
        for position, arg in enumerate(values):
            for buffer in self._buffers_of(arg):
                self.output_graph[buffer] = graph_index
                if position < returned:
                    self.held.add(buffer)

    def _buffers_of(self, arg: fx.Node) -> list[tuple]:
        root = self.root.get(self.key(arg))
        if root is None or root[0] == "input":
            return []
        if root[0] == "multi":  # every tensor under that index path
            prefix = ("buf", *root[1:])
            return [b for b in self.size if b[:len(prefix)] == prefix]
        return [root]

    def frees(self) -> dict[str, int]:
        """Task name → bytes freed when it ends (buffers that do not leave the iteration)."""
        freed: dict[str, int] = {}
        for buffer, size in self.size.items():
            if buffer in self.pooled or buffer in self.held:
                continue
            used = self.last_use.get(buffer)
            out = self.output_graph.get(buffer)
            if used is None or (out is not None and out >= used[0]):
                continue  # never read, or leaves as an output / saved tensor not read later
            freed[used[1]] = freed.get(used[1], 0) + size
        return freed


def _tensor_leaves(value, path: tuple = ()):
    """(index path, tensor) of each tensor in a nested tuple/list of outputs (an op returning
    ``Tensor[]`` beside tensors: a list inside the tuple)."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (tuple, list)):
        for index, item in enumerate(value):
            yield from _tensor_leaves(item, (*path, index))
