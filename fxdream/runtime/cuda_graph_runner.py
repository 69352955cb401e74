"""Run one FX region through CUDA graphs: capture once per shape key, then replay.

The cuda_graphs pass (passes/cuda_graphs.py) decides the regions; this module only runs
them, as lightning-thunder keeps its CUDA-graph runner apart from the transform.

A ``CudaGraphRunner`` wraps a region's GraphModule. On a call it looks up the *shape key*
(shape, stride, dtype and device of the inputs it copies; static inputs are checked by
address instead), and:

- first time for a key: allocate static input buffers, copy the inputs in, warm the region
  up on a side stream (cuDNN autotuning, lazy initialisation), capture it with
  ``torch.cuda.CUDAGraph`` into the runner's memory pool, and keep the static outputs;
- afterwards: copy the inputs into the static buffers (one ``_foreach_copy_``), replay,
  return the static outputs.

Static inputs (the pass flags parameters, buffers, constants and views of them) are read
in place, not copied: the graph keeps their addresses. If one of them moves (a
parameter replaced by a new tensor), that key is captured again ("re-recorded"; counted,
at most ``max_shapes`` times). At most ``max_shapes`` (default 8) shape keys are captured
per region (pytorch/pytorch #119640, #128424): a call at a further shape runs the region
eagerly, logs a warning once, and ``stats()`` says so. A capture that fails (an op that
synchronises, a CPU op) makes the region run eagerly for good, with the error as the
reason. ``strict=True`` raises ``CudaGraphFallback`` instead of any of these fallbacks.

Outputs: the runner returns its static output buffers, which the next replay overwrites.
The pass clones the outputs that leave the surrounding graph (``clone_outputs``, one
batched copy), so a caller never holds a buffer a later replay rewrites; outputs used only
inside the graph (by eager ops or another region) are consumed before the next replay and
are not copied. With ``guard_outputs`` (the pass's ``clone_outputs=False``) the runner
instead hands out aliases of those buffers and raises ``CudaGraphOutputOverwritten`` when
one from the previous call is still referenced at the next replay (only the returned
tensors themselves are tracked: a view made from one and kept alone is not seen).

Memory: each runner has its own pool, shared by its shape entries (see ``SharedPool``).
``memory_bytes()`` is what its captured graphs hold, measured at capture (growth of the
allocator's reserved memory during capture, plus the static input buffers).

Not thread-safe, and one stream at a time: replays and input copies go to the current stream.
"""
from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

log = logging.getLogger("fxdream")

MAX_SHAPES = 8
WARMUP_RUNS = 2


class CudaGraphFallback(RuntimeError):
    """strict=True: a region would have run without its CUDA graph."""


class CudaGraphOutputOverwritten(RuntimeError):
    """An output of the previous replay is still held and this replay would overwrite it."""


_PAUSED = [0]


@contextlib.contextmanager
def capture_paused():
    """Regions run their graphs as they are, neither captured nor replayed, nor counted as
    fallbacks: while fxdream times a rewritten graph in context or runs it for its outputs.
    That runs on copies of the buffers, so a capture there would hold the copies' addresses, and
    the first real call would re-record every region."""
    _PAUSED[0] += 1
    try:
        yield
    finally:
        _PAUSED[0] -= 1


class SharedPool:
    """One CUDA-graph memory pool, shared by the shape entries of one runner.

    Only one entry replays per call, and the outputs of the previous call are dead by then
    (cloned, or checked by the guard), so an entry may reuse another's temporaries. Pools are
    not shared across regions: a re-capture would break the capture order that sharing needs
    (a later-captured graph can take an earlier graph's temporaries for its outputs).
    """

    def __init__(self):
        self._handle = None

    def handle(self):
        if self._handle is None:
            self._handle = torch.cuda.graph_pool_handle()
        return self._handle


@dataclass
class _Entry:
    graph: torch.cuda.CUDAGraph
    static_inputs: list            # per input: the tensor the graph reads (or the value baked in)
    copy_dst: list                 # static buffers of the copied inputs, in _copy_idx order
    scalar_dst: list               # device scalars for 0-d CPU inputs, in _scalar_idx order
    static_ptrs: list              # data_ptr per input index (None where not checked)
    outputs: tuple
    memory_bytes: int


def _ptrs_equal(args, ptrs: list, indices: list) -> bool:
    """All static inputs still at their captured addresses (C++ helper of cudagraph trees if present)."""
    if not indices:
        return True
    fast = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)  # private, CUDA builds
    if fast is not None:
        try:
            return fast(list(args), ptrs, indices)
        except (TypeError, RuntimeError):  # an argument it does not take (None): check in Python
            pass
    return all(args[i].data_ptr() == ptrs[i] for i in indices)


def _as_tuple(out) -> tuple:
    """A region returns a tuple (the pass builds it so); a bare graph may return one tensor."""
    if isinstance(out, tuple):
        return out
    if isinstance(out, list):
        return tuple(out)
    return (out,)


def clone_outputs(*tensors):
    """Fresh copies of ``tensors`` (same strides when dense), in one batched copy."""
    outs = [torch.empty_like(t) for t in tensors]
    if len(outs) == 1:
        outs[0].copy_(tensors[0])
    elif outs:
        torch._foreach_copy_(outs, list(tensors))
    return tuple(outs)


class CudaGraphRunner(torch.nn.Module):
    """Calls ``region_graph`` through CUDA graphs, one capture per shape key (see module doc)."""

    def __init__(self, region_graph: fx.GraphModule, region_id: int, static_inputs, *,
                 max_shapes: int = MAX_SHAPES, pool: SharedPool | None = None, strict: bool = False,
                 guard_outputs=(), warmup: int = WARMUP_RUNS, label: str = ""):
        super().__init__()
        if max_shapes < 1:
            raise ValueError(f"max_shapes must be >= 1, got {max_shapes}")
        self.region_graph = region_graph
        self.region_id = region_id
        self.static_inputs = tuple(bool(s) for s in static_inputs)
        self.max_shapes = max_shapes
        self.strict = strict
        self.guard_outputs = tuple(guard_outputs)
        self.warmup = warmup
        self.label = label or f"region {region_id}"
        self._pool = pool or SharedPool()
        self._entries: dict[tuple, _Entry] = {}
        self._checked: list[int] = []     # static tensor inputs whose address is checked
        self._copy_idx: list[int] = []    # inputs copied into static buffers
        self._scalar_idx: list[int] = []  # 0-d CPU inputs, copied into device scalars
        self._layout_known = False
        self.eager_reason: str | None = None   # set: the region runs eagerly for good
        self.eager_calls = 0
        self.eager_shapes: set = set()
        self.rerecords = 0
        self.replays = 0
        self._warned: set[str] = set()
        self._handed_out: list = []  # weakrefs to the outputs of the last replay (guard mode)

    # --- the call ---------------------------------------------------------------------------
    def forward(self, *args):
        if _PAUSED[0]:
            return _as_tuple(self.region_graph(*args))
        if self.eager_reason is not None:
            return self._eager(args, self.eager_reason)
        if not self._layout_known:
            reason = self._learn_layout(args)
            if reason is not None:
                return self._fallback(args, reason, permanent=True)
        key = self._key(args)
        entry = self._entries.get(key)
        if entry is not None and not _ptrs_equal(args, entry.static_ptrs, self._checked):
            if self.rerecords >= self.max_shapes:
                return self._fallback(args, f"static inputs (parameters) moved more than {self.max_shapes} times",
                                      permanent=True)
            self.rerecords += 1
            del self._entries[key]
            if not self._entries:
                # the pool died with its last graph, and torch 2.11 asserts (use_count > 0 in
                # CUDACachingAllocator) when a capture reuses a dead pool's id: a new pool
                self._pool = SharedPool()
            entry = None
        if entry is None:
            if len(self._entries) >= self.max_shapes:
                self.eager_shapes.add(key)
                return self._fallback(args, f"more than {self.max_shapes} input shapes: new shapes run eagerly")
            entry = self._capture(args, key)
            if entry is None:
                return self._eager(args, self.eager_reason)
        return self._replay(entry, args)

    def _replay(self, entry: _Entry, args):
        if self.guard_outputs:
            self._check_overwrite()
        if self._copy_idx:
            torch._foreach_copy_(entry.copy_dst, [args[i] for i in self._copy_idx])
        for dst, i in zip(entry.scalar_dst, self._scalar_idx):
            dst.copy_(args[i])
        entry.graph.replay()
        self.replays += 1
        if not self.guard_outputs:
            return entry.outputs
        outputs = list(entry.outputs)
        for i in self.guard_outputs:
            outputs[i] = outputs[i].view(outputs[i].shape)  # a new alias object we can watch
        self._handed_out = [(i, weakref.ref(outputs[i])) for i in self.guard_outputs]
        return tuple(outputs)

    def _check_overwrite(self) -> None:
        """Any replay of this runner (any shape: entries share a pool) may overwrite them."""
        for i, ref in self._handed_out:
            if ref() is not None:
                raise CudaGraphOutputOverwritten(
                    f"{self.label}: output {i} returned by the previous call is still referenced, and this replay "
                    "would overwrite it; drop it (del) or .clone() it before calling again, or let the "
                    "cuda_graphs pass clone outputs (clone_outputs=True, the default)")

    def _eager(self, args, reason):
        self.eager_calls += 1
        if self.strict:
            raise CudaGraphFallback(f"{self.label}: strict=True and the region would run eagerly: {reason}")
        return _as_tuple(self.region_graph(*args))

    def _fallback(self, args, reason: str, permanent: bool = False):
        self._note_fallback(reason, permanent)
        return self._eager(args, reason)

    def _note_fallback(self, reason: str, permanent: bool) -> None:
        """Never silent: the reason is logged once and kept for ``stats()``/``describe()``."""
        if permanent:
            self.eager_reason = reason
        if reason not in self._warned:
            log.warning("fxdream cuda_graphs: %s runs eagerly: %s", self.label, reason)
            self._warned.add(reason)

    # --- shapes and layout --------------------------------------------------------------------
    def _learn_layout(self, args) -> str | None:
        """Which inputs are copied, checked in place, or CPU scalars; None when capturable."""
        device = self._find_device(args)
        if device is None:
            return "CUDA graphs need a CUDA device (no input of the region is on one)"
        self._device = device
        for i, (a, static) in enumerate(zip(args, self.static_inputs + (False,) * len(args))):
            if not isinstance(a, torch.Tensor):
                continue
            if a.device != device:
                if a.device.type != "cpu" or a.dim() != 0:
                    return f"input {i} is on {a.device} (shape {list(a.shape)}), not on {device}"
                self._scalar_idx.append(i)  # a 0-d CPU scalar: copied into a device scalar
            elif static:
                self._checked.append(i)
            else:
                self._copy_idx.append(i)
        self._layout_known = True
        return None

    def _key(self, args) -> tuple:
        """Shape key of the copied inputs (static inputs are checked by address, which is cheaper
        and catches a moved parameter too)."""
        return tuple((args[i].shape, args[i].stride(), args[i].dtype, args[i].device) for i in self._copy_idx) + \
            tuple(args[i].dtype for i in self._scalar_idx)

    # --- capture ------------------------------------------------------------------------------
    def _capture(self, args, key) -> _Entry | None:
        device = self._device
        static = list(args)
        copy_dst = [torch.empty_like(args[i], device=device) for i in self._copy_idx]
        scalar_dst = [torch.empty((), dtype=args[i].dtype, device=device) for i in self._scalar_idx]
        for dst, i in zip(copy_dst, self._copy_idx):
            dst.copy_(args[i])
            static[i] = dst
        for dst, i in zip(scalar_dst, self._scalar_idx):
            dst.copy_(args[i])
            static[i] = dst
        input_bytes = sum(t.numel() * t.element_size() for t in copy_dst + scalar_dst)
        try:
            with torch.no_grad():
                graph, outputs, pool_bytes = self._record(static, device)
        except Exception as error:  # an op that cannot be captured: this region runs eagerly
            _repair_rng_after_failed_capture(device)
            first = str(error).strip().splitlines()[0] if str(error).strip() else ""
            self._note_fallback(f"capture failed: {type(error).__name__}: {first}", permanent=True)
            return None
        ptrs = [None] * len(args)
        for i in self._checked:
            ptrs[i] = args[i].data_ptr()
        entry = _Entry(graph, static, copy_dst, scalar_dst, ptrs, outputs, input_bytes + pool_bytes)
        self._entries[key] = entry
        return entry

    def _find_device(self, args) -> torch.device | None:
        """The CUDA device the region runs on: that of its first CUDA input."""
        return next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)

    def _record(self, static: list, device: torch.device):
        """Warm up on a side stream, then capture into the runner's pool: (graph, outputs, pool bytes)."""
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self.region_graph(*static)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool.handle()):
            before = torch.cuda.memory_reserved(device)  # after graph()'s own empty_cache
            outputs = _as_tuple(self.region_graph(*static))
        after = torch.cuda.memory_reserved(device)
        return graph, outputs, max(0, after - before)

    # --- what it did ----------------------------------------------------------------------------
    def memory_bytes(self) -> int:
        """Device memory the captured graphs hold (measured at capture)."""
        return sum(e.memory_bytes for e in self._entries.values())

    def stats(self) -> dict:
        return dict(region=self.region_id, label=self.label, shapes_captured=len(self._entries),
                    replays=self.replays, eager_calls=self.eager_calls, eager_reason=self.eager_reason,
                    eager_shapes=len(self.eager_shapes), rerecords=self.rerecords,
                    memory_bytes=self.memory_bytes(), kernels=sum(
                        1 for n in self.region_graph.graph.nodes if n.op == "call_function"))

    def describe(self) -> str:
        s = self.stats()
        text = (f"{self.label}: {s['shapes_captured']} shape(s) captured, {s['replays']} replays, "
                f"{s['memory_bytes'] / 2**20:.1f} MiB held")
        if s["rerecords"]:
            text += f", re-recorded {s['rerecords']}x (static input addresses changed)"
        if self.eager_reason:
            text += f"; runs eagerly: {self.eager_reason} ({s['eager_calls']} calls)"
        elif s["eager_shapes"]:
            text += (f"; {s['eager_calls']} call(s) at {s['eager_shapes']} further shape(s) ran eagerly "
                     f"(cap {self.max_shapes} shapes)")
        return text

    def reset(self) -> None:
        """Drop every captured graph (their memory goes back to the allocator)."""
        self._entries.clear()


def runners(obj) -> list[CudaGraphRunner]:
    """The runners in a GraphModule, an OptimizedModule (its rewritten graphs) or an iterable of them."""
    if isinstance(obj, CudaGraphRunner):
        return [obj]
    if isinstance(obj, torch.nn.Module) and not hasattr(obj, "rewritten_graphs"):
        return [m for m in obj.modules() if isinstance(m, CudaGraphRunner)]
    graphs = obj.rewritten_graphs.values() if hasattr(obj, "rewritten_graphs") else obj
    found: list[CudaGraphRunner] = []
    for gm in graphs:
        for r in runners(gm):
            if all(r is not f for f in found):
                found.append(r)
    return found


def describe_runners(obj) -> tuple[str, ...]:
    """One line per runner: shapes captured, replays, memory held, eager fallbacks and why."""
    return tuple(r.describe() for r in runners(obj))


def cuda_graph_memory_bytes(obj) -> int:
    """Device memory all captured graphs of ``obj`` hold (measured at capture)."""
    return sum(r.memory_bytes() for r in runners(obj))


def _repair_rng_after_failed_capture(device: torch.device) -> None:
    """Leave the device's RNG usable after a capture that raised.

    torch 2.11 marks the default CUDA generator "capturing" at capture_begin and clears the
    mark only at a successful capture_end, so after a failed capture every random op on the
    device raises "Offset increment outside graph capture encountered unexpectedly" (dropout,
    randn, an RNN's init). An empty capture runs capture_begin and
    capture_end once more on the same generator state, which clears the mark, also for
    graphs captured before that share the state. The RNG stream does not move."""
    if device is None or device.type != "cuda":
        return
    try:
        with torch.cuda.device(device), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "The CUDA Graph is empty"
            torch.cuda.synchronize()
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                pass
    except Exception as error:  # noqa: BLE001  (best effort; the region runs eagerly anyway)
        log.warning("fxdream: could not reset the CUDA RNG state after a failed capture: %s", error)
