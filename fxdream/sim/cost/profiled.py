"""Cost models: how long one FX node takes to dispatch on the host and to run as a kernel.

``Analytic(DeviceSpec)`` is a roofline: max(FLOPs / peak, bytes / bandwidth), floored at
the device's smallest kernel, plus a fixed dispatch/launch cost per op. It predicts for
any GPU from its datasheet. ``Profiled`` measures each op on this machine at its exact
shapes (blocks of calls, median of rounds) and caches the result by op + shapes + dtype
+ device, so a replacement op a pass inserts is measured, not guessed. Profiles are JSON.
"""
from __future__ import annotations

import json
import logging
import math
import statistics
from pathlib import Path

import torch
import torch.fx as fx

from fxdream.capturing.captured import captured_parts
from fxdream.capturing.dynamo import describe_error
from fxdream.ir.nodes import is_view, op_name
from fxdream.ir.tensors import real_tensors
from fxdream.runtime.direct_calls import direct
from fxdream.sim.cost.analytic import Analytic
from fxdream.sim.cost.devices import DeviceSpec
from fxdream.sim.cost.model import CostModel
from fxdream.sim.cost.run_spread import RunSpread
from fxdream.sim.cost.side_by_side import interleaved_runs, warm_runs
from fxdream.sim.profile.cuda_timing import graph_kernel_saving_us, time_calls_cuda
from fxdream.sim.profile.host_timing import (
    ModuleBuilder,
    _time_calls,
    as_graph_module,
    measure_call_overhead_us,
    measure_graph_call_us,
    measure_view_us,
)
from fxdream.sim.profile.in_context import (  # noqa: F401  (MIN_ROUNDS)
    HOST,
    MIN_ROUNDS,
    compute_keys,
    compute_nodes,
    ones_like,
    owned_copies,
    synthetic_args,
    time_graph,
)
from fxdream.sim.profile.op_keys import profile_key

log = logging.getLogger("fxdream")

# In-context profiling of one graph: no new round past this (seconds), after MIN_ROUNDS, so a
# graph whose run takes more than PROFILE_BUDGET_S / MIN_ROUNDS stops at MIN_ROUNDS: more rounds
# cost build time without a better prediction.
PROFILE_BUDGET_S = 0.1
# The interleaved rounds that time the graphs a decision compares side by side: as many as fit
# this budget (seconds), at least 2 (a median) and at most SIDE_BY_SIDE_MAX_ROUNDS: graphs of a
# few ms take many rounds for the budget's cost, and their medians move with a noisy second.
SIDE_BY_SIDE_BUDGET_S = 0.3
SIDE_BY_SIDE_MAX_ROUNDS = 15
RUN_SPREAD_COVER = 0.9  # run_spread_of: the share of a graph's cost a timed graph must hold
FEW_NEW_OPS = 4     # worth_timing_in_context: at most this many distinct new ops, ...
MIN_SHARE = 0.01    # ... under this share of the graph's time, are not timed in context


class Profiled:
    """Costs measured on this machine: each distinct op+shapes is timed once and cached.

    ``kernel_us`` is the measured time of one call of the op (on CPU this includes the
    ATen dispatch; on a GPU it is the kernel alone, see ``cuda_timing``); ``dispatch_us`` is
    the Python cost of one generated-code call, measured once per process, plus on a GPU the
    op's measured host time (dispatch and launch). ``save``/``load`` keep the measurements as JSON.
    """

    def __init__(self, device: DeviceSpec, torch_device: str | torch.device = "cpu",
                 measurements: dict | None = None, rounds: int = 5, target_block_us: float = 2000.0,
                 build_module: ModuleBuilder = as_graph_module, context_rounds: int | None = None):
        self.device = device
        # timed runs of each graph profiled in context: None for the default (up to 5, stopping
        # once PROFILE_BUDGET_S is spent past MIN_ROUNDS); a number for exactly that many
        self.context_rounds = context_rounds
        self.build_module = build_module  # how the graph-call probe builds its one-op module
        self.torch_device = torch.device(torch_device)
        self.measurements: dict[str, float] = dict(measurements or {})
        self.rounds = rounds
        self.target_block_us = target_block_us
        self._fallback = Analytic(device)
        self._call_overhead_us: float | None = None
        self._profiled: set[int] = set()
        self.samples: dict[str, list[float]] = {}  # in-context times (µs) by key, every run so far
        self.run_spreads: list[RunSpread] = []  # whole runs' spread, from side-by-side rounds
        # counts changes of a cost already taken: a prediction memoized at another revision is stale
        self.revision = 0

    def kernel_us(self, node: fx.Node) -> float:
        return self._cached(node, "")

    def isolated_us(self, node: fx.Node) -> float:
        """``node``'s op timed alone at its shapes (a loop of calls), even where it was timed in
        context: a pass comparing two ops before building a graph with either compares like with
        like. Cached per key."""
        return self._cached(node, "isolated|")

    def _cached(self, node: fx.Node, prefix: str) -> float:
        """The measurement under ``prefix`` + the node's key, micro-benchmarked once if missing
        (on a GPU its host time is kept too, under ``HOST`` + that key)."""
        if is_view(node):
            return 0.0
        key = prefix + profile_key(node, self.torch_device.type)
        if key not in self.measurements and "isolated|" + key in self.measurements:
            return self.measurements["isolated|" + key]  # timed alone already: the same benchmark
        if key not in self.measurements:
            with real_tensors():
                device_us, host_us = self._measure(node)
            self.measurements[key] = device_us
            if host_us is not None:
                self.measurements[HOST + key] = host_us
        return self.measurements[key]

    def graph_kernel_us(self, node: fx.Node) -> float:
        """``node``'s kernel replayed from a CUDA graph: its measured time less what a graph saves
        per kernel on this GPU (``cuda_timing.graph_kernel_saving_us``, measured once and kept
        with the profile), never below the device's smallest kernel or the kernel itself."""
        kernel = self.kernel_us(node)
        if self.torch_device.type != "cuda" or kernel == 0.0:
            return kernel
        return max(kernel - self.graph_saving_us(), min(kernel, self.device.kernel_min_us))

    def graph_saving_us(self) -> float:
        """Device µs a CUDA-graph replay saves per kernel on this GPU (measured once)."""
        return self._once("graph_kernel_saving", lambda: graph_kernel_saving_us(self.torch_device))

    def dispatch_us(self, node: fx.Node) -> float:
        if is_view(node):
            return self.call_overhead_us() + self.view_us()
        if self.torch_device.type != "cuda":
            return self.call_overhead_us()  # on a CPU the op's own time is all in kernel_us
        return self.call_overhead_us() + self.host_us(node)

    def host_us(self, node: fx.Node) -> float:
        """On a GPU: the host's dispatch and launch of ``node``'s op, measured with its kernel time
        (in context, or timed alone), never guessed from a datasheet."""
        key = profile_key(node, self.torch_device.type)
        for measured in (HOST + key, HOST + "isolated|" + key):
            if measured in self.measurements:
                return self.measurements[measured]
        self.isolated_us(node)
        return self.measurements.get(HOST + "isolated|" + key, self.device.launch_overhead_us)

    def call_overhead_us(self) -> float:
        """Python cost per op of generated code beyond the op itself (measured once per process)."""
        if self._call_overhead_us is None:
            with real_tensors():
                self._call_overhead_us = measure_call_overhead_us()
        return self._call_overhead_us

    def graph_call_us(self) -> float:
        return self._once("graph_call", lambda: measure_graph_call_us(self.torch_device, self.build_module))

    def _once(self, what: str, measure) -> float:
        """A measurement of this device taken once (real tensors) and kept with the profile."""
        key = f"__{what}__|{self.torch_device.type}"
        if key not in self.measurements:
            with real_tensors():
                self.measurements[key] = measure()
        return self.measurements[key]

    def measure_overheads(self) -> None:
        """Measure the per-call and per-op host overheads now, outside any capture: measured in
        the middle of one (aot_autograd's compiler callback), the cost of calling a compiled graph
        reads several times too high, and a small model's step is predicted that much too slow."""
        self.graph_call_us()
        self.view_us()
        self.call_overhead_us()

    def view_us(self) -> float:
        return self._once("view", lambda: measure_view_us(self.torch_device))

    def utilization(self, node: fx.Node) -> float:
        return self._fallback.utilization(node)

    def _measure(self, node: fx.Node) -> tuple[float, float | None]:
        """(device µs, host µs) of one call, timed alone; host is None on a CPU (one thread
        does both)."""
        if not callable(node.target) or isinstance(node.target, str):
            return 0.0, None
        try:
            args, kwargs = synthetic_args(node, self.torch_device)
            op = direct(node.target)  # as graph code calls it (``direct_calls``)
            call = lambda: op(*args, **kwargs)  # noqa: E731
            if self.torch_device.type == "cuda":
                return time_calls_cuda(call, self.rounds, self.target_block_us)
            return _time_calls(call, self.rounds, self.target_block_us), None
        except Exception as error:  # an op that cannot run on synthetic inputs: fall back to the roofline
            # said aloud: a pass comparing this guess with measured times compares unlike things
            log.warning("%s could not be timed alone (%s); its cost is the analytic model's guess",
                        op_name(node), describe_error(error))
            return self._fallback.kernel_us(node), None

    @property
    def in_context(self) -> set[str]:
        """Keys measured inside a real graph run."""
        return set(self.samples)

    def profile_in_context(self, captured, rounds: int | None = None, warmup: int = 2, graphs: dict | None = None,
                           again: bool = False) -> None:
        """Time every node where it really runs: the captured graphs on their real inputs.

        An op timed alone in a loop runs with hot caches and a warm allocator; inside the
        model it does not. So each node is timed inside a run of its graph, by clock reads in
        the graph's generated code (median over runs and over nodes with the same key); ops a pass adds later are
        still micro-benchmarked unless their rewritten graph is given in ``graphs``
        ((subgraph index, phase) → GraphModule), which is then timed in context as well.
        A key's cost is the median of all its samples so far; ``again=True`` profiles graphs
        already profiled once more, adding samples (interleave it with measurements and the
        prediction sees the same machine conditions they do).
        """
        for part in captured_parts(captured):
            if not part.example_inputs:
                continue
            rewritten = [(graphs or {}).get((part.index, phase)) for phase in ("fw", "bw")]
            todo = [gm for gm in rewritten if gm is not None and self.to_time_in_context(gm)]
            if not again and id(part) not in self._profiled and not any(
                    self.to_time_in_context(gm) for gm in (part.forward, part.backward) if gm is not None):
                self._profiled.add(id(part))  # e.g. a pass pipeline timed them already
            if id(part) in self._profiled and not todo and not again:
                continue
            # only a pass's new ops, unless ``again``: a key's median must not move between the
            # prediction before a rewrite and the one after it (noise would become a delta)
            base_new_only = id(part) in self._profiled and not again
            self._profiled.add(id(part))
            fw_values = self.profile_graph(part.forward, part.example_inputs, rounds, warmup,
                                           new_keys_only=base_new_only)
            if rewritten[0] is not None and (again or rewritten[0] in todo):
                self.profile_graph(rewritten[0], part.example_inputs, rounds, warmup, new_keys_only=not again)
            if part.backward is not None and fw_values is not None:
                bw_inputs = self.backward_inputs(part.backward, fw_values)
                for gm, new_only in ((part.backward, base_new_only), (rewritten[1], not again)):
                    if gm is not None:
                        self.profile_graph(gm, bw_inputs, rounds, warmup, new_keys_only=new_only)

    def profile_graph(self, gm: fx.GraphModule, inputs, rounds: int | None = None, warmup: int = 0,
                      budget_s: float | None = None, new_keys_only: bool = False,
                      give_up_above_us: float = math.inf, raise_errors: bool = False,
                      one_round_above_s: float = math.inf, one_round_under_us: float = math.inf) -> dict | None:
        """Measure ``gm``'s nodes in context; return its outputs by node name (None if it cannot run).

        Past ``MIN_ROUNDS`` timed rounds, no new round starts once they took ``budget_s``: a
        graph that runs for more than ~30 ms stops at 3 rounds, not 5.
        No warm-up run: the first call builds a new variant's oneDNN primitives, but rounds are
        level from the second run on, and the median of ≥ 3 rounds outvotes the one slow
        round; a warm-up run costs a whole run of build time per graph and predicts no closer.
        ``new_keys_only``: keep samples only for ops not measured yet (a rewrite's new ops), so
        the costs a prediction of the unrewritten graph used stay as they were.
        ``give_up_above_us``: no third round where both first ones took longer (``time_graph``).
        ``raise_errors``: a graph that raises when run raises here, instead of giving None.
        ``one_round_above_s``: one timed round where it took longer, and its graph less than
        ``one_round_under_us`` (``time_graph``)."""
        if rounds is None:
            rounds = self.context_rounds or 5
        if budget_s is None:
            budget_s = math.inf if self.context_rounds else PROFILE_BUDGET_S
        inputs = owned_copies(inputs, gm)
        samples: dict[str, list[float]] = {}
        with real_tensors():
            values = time_graph(gm, inputs, self.torch_device, samples, rounds, warmup, budget_s, give_up_above_us,
                                raise_errors, every_round=self.context_rounds is not None,
                                one_round_above_s=one_round_above_s, one_round_under_us=one_round_under_us)
        for key, times in samples.items():
            if new_keys_only and key in self.samples:
                continue
            self.samples.setdefault(key, []).extend(times)
            self._set(key, statistics.median(self.samples[key]))
        return values

    def profile_side_by_side(self, graphs: list[tuple[fx.GraphModule, object]], rounds: int | None = None) -> int:
        """Time ``graphs`` ((graph, its real inputs), each run already once: warm) in the same
        interleaved rounds, each round running every graph once in a rotated order, and make those
        rounds the only samples of every key they timed. Two graphs a decision compares are then
        costed from the same minutes of this machine: drift, a busy spell or a first-call effect
        hits both alike, and their predicted ratio is a ratio measured side by side. Default
        rounds: as many as ``SIDE_BY_SIDE_BUDGET_S`` allows, 2 to ``SIDE_BY_SIDE_MAX_ROUNDS``
        (``context_rounds``: exactly that many). Returns the rounds run (0 where a graph did not run)."""
        if rounds is None:
            rounds = self.context_rounds or self._rounds_in_budget(graphs)
        with real_tensors():
            runs = interleaved_runs(self, [(gm, owned_copies(inputs, gm)) for gm, inputs in graphs], rounds)
        if runs is None:
            return 0
        samples: dict[str, list[float]] = {}
        for gm, _ in graphs:
            warm = warm_runs(runs[id(gm)])
            for run in warm:
                for key, times in run.samples.items():
                    samples.setdefault(key, []).extend(times)
            counted = [run.page_faults for run in warm if run.page_faults is not None]
            spread = RunSpread.of_runs(frozenset(self.keys_of(gm)), [run.total_us for run in warm], counted or None)
            if spread is not None:
                self.run_spreads.append(spread)
        for key, times in samples.items():
            self.samples[key] = times
            self._set(key, statistics.median(times))
        return rounds

    def _set(self, key: str, us: float) -> None:
        """``key``'s cost is ``us`` from now on; a change of a cost already taken (its own, or the
        isolated timing that stood in for it) is a new revision."""
        taken = self.measurements.get(key, self.measurements.get("isolated|" + key))
        if taken is not None and taken != us:
            self.revision += 1
        self.measurements[key] = us

    def _rounds_in_budget(self, graphs: list[tuple[fx.GraphModule, object]]) -> int:
        round_us = sum(self.graph_total_us(gm) for gm, _ in graphs)
        return max(2, min(SIDE_BY_SIDE_MAX_ROUNDS, int(SIDE_BY_SIDE_BUDGET_S * 1e6 / max(round_us, 1.0))))

    def keys_of(self, gm: fx.GraphModule) -> list[str]:
        """The profile keys of ``gm``'s compute ops, in graph order."""
        return compute_keys(gm, self.torch_device.type)

    def share_outside(self, gm: fx.GraphModule, keys: set[str]) -> float:
        """The share of ``gm``'s summed op costs in ops whose key is not in ``keys`` (of its ops,
        where none has a cost yet)."""
        costs = [(key, self.measurements.get(key, 0.0)) for key in self.keys_of(gm)]
        total = sum(us for _, us in costs)
        if not total:  # nothing measured yet: the share of its ops
            return sum(key not in keys for key, _ in costs) / len(costs) if costs else 0.0
        return sum(us for key, us in costs if key not in keys) / total

    def run_spread_of(self, gm: fx.GraphModule) -> RunSpread | None:
        """The spread of whole runs measured for the graph timed side by side that holds most of
        ``gm``'s cost (at least ``RUN_SPREAD_COVER`` of it): ``gm`` itself, or the graph a final
        clean-up pass rewrote a few ops of. None where no such graph was timed."""
        best = None
        for spread in reversed(self.run_spreads):  # the latest first: it wins a tie
            covered = 1.0 - self.share_outside(gm, spread.keys)
            if covered >= RUN_SPREAD_COVER and (best is None or covered > best[0]):
                best = (covered, spread)
        return None if best is None else best[1]

    def page_faults_per_run(self, graphs) -> float | None:
        """The page faults of a run of each of ``graphs`` summed, as the side-by-side rounds of
        the graph that holds its cost counted them (``run_spread_of``); None where none was counted."""
        counted = [spread.page_faults_per_run for spread in map(self.run_spread_of, graphs)
                   if spread is not None and spread.page_faults_per_run is not None]
        return float(sum(counted)) if counted else None

    def graph_total_us(self, gm: fx.GraphModule) -> float:
        """The sum of ``gm``'s compute ops' current costs (a run's length, for budgets)."""
        return sum(self.measurements.get(key, 0.0) for key in self.keys_of(gm))

    def run_graph(self, gm: fx.GraphModule, inputs) -> dict | None:
        """``gm``'s outputs by node name from one untimed run (None if it cannot run alone)."""
        with real_tensors():
            return time_graph(gm, owned_copies(inputs, gm), self.torch_device, {}, rounds=0, warmup=1)

    def measured_in_context(self, gm: fx.GraphModule) -> bool:
        """Whether every compute node of ``gm`` has an in-context measurement."""
        return all(key in self.samples for key in compute_keys(gm, self.torch_device.type))

    def to_time_in_context(self, gm: fx.GraphModule) -> bool:
        """Whether ``gm`` has ops without an in-context time that are worth timed runs of it."""
        return not self.measured_in_context(gm) and self.worth_timing_in_context(gm)

    def worth_timing_in_context(self, gm: fx.GraphModule) -> bool:
        """Whether ``gm``'s ops not yet timed in context are worth timed runs of the whole graph.

        Not when they are a few ops (≤ ``FEW_NEW_OPS``) and, timed alone, under ``MIN_SHARE``
        of the graph: their micro-benchmarks stand in, and the error that allows is under that
        share, where timing them in context costs several runs of the whole graph. Always when
        every op is new (one op compiling the whole graph): timing them alone would cost as much
        as runs of the graph, with nothing known to weigh them against."""
        keys = compute_keys(gm, self.torch_device.type)
        new = {key for key in keys if key not in self.samples}
        if len(new) > FEW_NEW_OPS or new == set(keys):
            return True
        times = [self.kernel_us(node) if key in new else self.measurements[key]  # new: timed alone now
                 for node, key in zip(compute_nodes(gm), keys)]
        new_us = sum(t for t, key in zip(times, keys) if key in new)
        return new_us >= MIN_SHARE * sum(times)

    def backward_inputs(self, bw: fx.GraphModule, fw_values: dict) -> list:
        """Saved tensors from the forward's outputs (same names), ones for the incoming gradients."""
        return [fw_values.get(n.name, ones_like(n.meta.get("val"), self.torch_device))
                for n in bw.graph.nodes if n.op == "placeholder"]

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps({"device": self.device.name, "torch": torch.__version__,
                                          "measurements_us": self.measurements}, indent=1, sort_keys=True))

    @classmethod
    def load(cls, path: str | Path, device: DeviceSpec, torch_device="cpu") -> "Profiled":
        data = json.loads(Path(path).read_text())
        if data.get("device") != device.name:
            raise ValueError(f"profile {path} was measured on {data.get('device')!r}, not {device.name!r}")
        return cls(device, torch_device, data["measurements_us"])


def total_us(cost: CostModel, gm: fx.GraphModule) -> float:
    """Sum of dispatch + kernel over a graph: a serial lower bound check, not a simulation."""
    return sum(cost.dispatch_us(n) + cost.kernel_us(n) for n in gm.graph.nodes
               if n.op == "call_function")

