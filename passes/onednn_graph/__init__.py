"""onednn_graph: a CPU inference graph run whole by oneDNN Graph (TorchScript's LLGA fuser).

Every oneDNN convolution torch calls from Python or from an FX graph builds its primitive's
descriptor again on each call (``ideep``'s per-call setup: tens of µs, more than a small
convolution's kernel; docs/passes/onednn_graph.md has the measurements), where ONNX Runtime and
OpenVINO build theirs once. oneDNN Graph, reached through TorchScript
(``torch.jit.enable_onednn_fusion``), compiles its partitions (conv + BatchNorm + ReLU + residual
add, linear + activation, pooling) once and runs them from a cache, with no Python between ops.

The rewrite: the graph's parameters become constants, the ATen ops that oneDNN Graph only
recognises in their composite form are written back in it (``convolution`` → ``conv2d``,
``_native_batch_norm_legit_no_training`` → ``batch_norm``, ``native_layer_norm`` →
``layer_norm``, ``max_pool2d_with_indices`` → ``max_pool2d``, ``addmm(b, x, t(w))`` and
``addmm(b, x, w)`` of a constant ``w`` → ``linear``, a ``cat`` onto an empty KV cache without
it; a tanh GELU as its formula, which the fuser would run in erf form), and that graph is
traced, frozen and run
with the fuser on until TorchScript has compiled it. The FX graph then calls the compiled module
as one op, timed in context like any other, so the prediction is of what runs. Its output must
equal the graph's on random inputs of the graph's shapes (to float32 rounding), else the pass
declines. The fuser's switch is process-wide: it is on only while the build compiles.

``passes="auto"`` compares it as an alternative of its own (``alone``): on the graph as captured,
never combined with the other passes, whose rewrites it would undo. Compiling costs a trace, a
freeze and two runs; the compiled module is specialised to the example's shapes (another shape
compiles a new graph, as fxdream does for any traced graph); and the graph's layers are one op in
the report's per-layer times. Declines where this torch has no oneDNN Graph fuser, and where a
partition may crash the bridge (``bridge_hazards``).
"""
from __future__ import annotations

import hashlib
import operator
import warnings
from types import MappingProxyType

import torch
import torch.fx as fx

from fxdream.ir.aliasing import written_inputs
from fxdream.pass_api import (
    LAYER,
    PassBase,
    PassContext,
    PassResult,
    copy_graph_module,
    kept_if_faster,
    real_tensors,
    register_pass,
)
from fxdream.passes.onednn_graph.bridge_hazards import crashing_partition
from fxdream.passes.onednn_graph.composite import composite_graph, flat_outputs
from fxdream.sim.cost.profiled import Profiled

aten = torch.ops.aten
WARM_UP_RUNS = 2  # TorchScript's profiling executor profiles the first run and compiles on the second
TOLERANCE = dict(rtol=1e-4, atol=1e-4)  # the fused kernels sum in another order than ATen's
LAYER_NAME = "(oneDNN Graph)"
NOT_FIXED_TENSORS = ("an input that is not a tensor, a symbolic size, or an output that is not a computed tensor: "
                     "oneDNN Graph compiles tensors of fixed sizes")


def has_llga() -> bool:
    """Whether this torch has TorchScript's oneDNN Graph fuser and oneDNN."""
    return torch.backends.mkldnn.is_available() and hasattr(torch._C, "_jit_set_llga_enabled")


class CompiledGraph:
    """The op an FX graph calls: a frozen TorchScript module compiled by oneDNN Graph, named by
    its graph's code (its profile key: two graphs of the same code cost the same)."""

    def __init__(self, script: torch.jit.ScriptModule, fingerprint: str):
        self.script = script
        self.__name__ = f"onednn_graph_{fingerprint}"

    def __call__(self, *inputs):
        return self.script(*inputs)

    def __repr__(self) -> str:
        return self.__name__


def example_activations(placeholders: list[fx.Node]) -> list[torch.Tensor]:
    """Random real tensors of the placeholders' shapes, strides and dtypes (integers: zeros)."""
    out = []
    for node in placeholders:
        value = node.meta["val"]
        tensor = torch.empty_strided(tuple(value.shape), tuple(value.stride()), dtype=value.dtype)
        out.append(tensor.normal_() if tensor.is_floating_point() else tensor.zero_())
    return out


def compile_with_llga(graph: fx.GraphModule,
                      example: list[torch.Tensor]) -> tuple[torch.jit.ScriptModule, tuple, tuple]:
    """``graph`` traced, frozen, and run on ``example`` with oneDNN Graph's fuser on until
    compiled; with the compiled run's outputs and ``graph``'s own (those of the run the trace
    records, so that the check against them costs no run of its own). The fuser's process-wide
    switch is put back as it was."""
    traced_outputs = []
    recording = graph.register_forward_hook(lambda module, args, outputs: traced_outputs.append(outputs))
    enabled = torch.jit.onednn_fusion_enabled()
    torch.jit.enable_onednn_fusion(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", torch.jit.TracerWarning)
            warnings.simplefilter("ignore", DeprecationWarning)  # TorchScript's, printed on every build
            script = torch.jit.freeze(torch.jit.trace(graph.eval(), tuple(example), check_trace=False))
        for _ in range(WARM_UP_RUNS):
            outputs = script(*example)
    finally:
        recording.remove()
        torch.jit.enable_onednn_fusion(enabled)
    return script, outputs, traced_outputs[0]


def _last_line(error: Exception) -> str:
    """The message's last line: TorchScript puts its interpreter's boilerplate first and the
    error it ran into last ("RuntimeError: vector::_M_range_check: ...")."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _fingerprint(graph: fx.GraphModule, example: list[torch.Tensor]) -> str:
    shapes = ";".join(f"{tuple(t.shape)}{tuple(t.stride())}{t.dtype}" for t in example)
    return hashlib.sha1((graph.code + shapes).encode()).hexdigest()[:12]


def calling_graph(gm: fx.GraphModule, op: CompiledGraph, activations: list[fx.Node]) -> fx.GraphModule:
    """A copy of ``gm`` that calls ``op`` on its activations: ``op`` returns ``gm``'s distinct
    outputs in order (``composite_graph``'s), read from its result; every other op is gone (the
    placeholders stay: the caller passes them)."""
    new = copy_graph_module(gm)
    names = {n.name for n in activations}
    output = new.graph.output_node()
    flat = flat_outputs(new.graph)
    items = {}
    with new.graph.inserting_before(output):
        call = new.graph.call_function(op, tuple(n for n in new.graph.nodes if n.op == "placeholder"
                                                 and n.name in names))
        distinct = tuple(dict.fromkeys(flat))
        call.meta["val"], call.meta[LAYER] = tuple(o.meta["val"] for o in distinct), LAYER_NAME
        for i, old in enumerate(distinct):
            items[old] = new.graph.call_function(operator.getitem, (call, i))
            items[old].meta["val"], items[old].meta[LAYER] = old.meta["val"], LAYER_NAME
    returned = output.args[0]
    output.args = (type(returned)(items[o] for o in flat) if isinstance(returned, (tuple, list)) else items[flat[0]],)
    for node in reversed(list(new.graph.nodes)):
        if node.op in ("call_function", "call_method", "call_module", "get_attr") and not node.users:
            new.graph.erase_node(node)
    new.recompile()
    return new


@register_pass
class OneDnnGraph(PassBase):
    name = "onednn_graph"
    devices = ("cpu",)
    modes = ("inference",)
    phases = ("fw",)
    alone = True  # it compiles the whole graph: the other passes' rewrites would be undone
    why_not = MappingProxyType({
        "device": "oneDNN Graph runs on the CPU; on {device} the graph is left as it is",
        "mode": "oneDNN Graph runs frozen inference graphs: training is left as it is",
        "phase": "inference graphs only",
    })

    def requires(self, ctx: PassContext) -> str | None:
        if not has_llga():
            return "this torch has no oneDNN Graph fuser (TorchScript's LLGA) or no oneDNN"
        if ctx.cost_model is not None and not isinstance(ctx.cost_model, Profiled):
            return ("its compiled op (the whole graph) has no analytic cost: it is predicted only from costs "
                    "measured here (cost='profiled')")
        return None

    def __call__(self, gm: fx.GraphModule, ctx: PassContext) -> PassResult:
        written = written_inputs(gm)
        if written is None:
            return PassResult.unchanged(gm, "the graph calls what is not an ATen op (torch.cond's branches, a "
                                            "Python function): which inputs it writes cannot be told, and freezing "
                                            "would fold the values it updates")
        if written:
            return PassResult.unchanged(gm, "the graph writes to its inputs (a buffer updated in forward, an in-place "
                                            "op on an input): freezing would fold the values it updates")
        with real_tensors(), torch.no_grad():  # the pipeline may run passes under a fake mode
            built = composite_graph(gm, ctx)
            if built is None:
                return PassResult.unchanged(gm, NOT_FIXED_TENSORS)
            composite, activations = built
            hazard = crashing_partition(composite.graph)
            if hazard is not None:
                return PassResult.unchanged(gm, f"a partition at {hazard.meta.get(LAYER) or hazard.name} may read one "
                                                "tensor twice and add into another, which crashes TorchScript's oneDNN "
                                                "Graph bridge (the whole process): left as it is")
            example = example_activations(activations)
            try:
                script, found, expected = compile_with_llga(composite, example)
            except Exception as error:  # noqa: BLE001  a compile that fails in any way leaves the graph as it is
                return PassResult.unchanged(gm, f"oneDNN Graph could not compile or run the graph "
                                                f"({type(error).__name__}: {_last_line(error)[:160]})")
            if any(e.shape != f.shape or e.dtype != f.dtype for e, f in zip(expected, found)):
                return PassResult.unchanged(gm, "oneDNN Graph's outputs differ from the graph's in shape or dtype "
                                                "(such as a 0-d tensor made 1-d): left as it is")
            if not all(torch.allclose(e, f, **TOLERANCE, equal_nan=True) for e, f in zip(expected, found)):
                return PassResult.unchanged(gm, "oneDNN Graph's result differs from the graph's beyond float32 "
                                                "rounding on random inputs: left as it is")
        op = CompiledGraph(script, _fingerprint(composite, example))
        fused = sum(1 for n in composite.graph.nodes if n.op == "call_function")
        rewritten = calling_graph(gm, op, activations)
        return kept_if_faster(ctx, gm, rewritten, f"{fused} ops compiled by oneDNN Graph as one op")
