"""Simulator semantics on hand-computed 2-6 task graphs (every expected value is derived in a
comment)."""
import pytest

from fxdream.sim import Contention, DepKind, Task, TaskGraph, simulate
from fxdream.sim.simulate import OPTIMIZER_STEP
from fxdream.sim.task import TaskKind


def launch_chain(launch_us, kernel_us, n=3):
    """cpu:0 runs L1..Ln back to back; Li launches Ki on stream:0 (same-stream chain)."""
    g = TaskGraph()
    for i in range(1, n + 1):
        g.append(Task.cpu(f"L{i}", launch_us, layer=f"layer{i}"))
        g.append(Task.gpu(f"K{i}", kernel_us, layer=f"layer{i}"), deps=[f"L{i}"])
    return g


def test_launch_bound_chain():
    tl = simulate(launch_chain(5.0, 2.0))
    # L1 0-5, K1 5-7; L2 5-10, K2 10-12; L3 10-15, K3 15-17: makespan = 3*5 + 2 = 17
    assert tl.times["K1"] == (5.0, 7.0)
    assert tl.times["K3"] == (15.0, 17.0)
    assert tl.makespan_us == 17.0
    assert tl.busy_us == {"cpu:0": 15.0, "stream:0": 6.0}     # 3*5 and 3*2
    assert tl.critical_path == ("L1", "L2", "L3", "K3")       # the CPU is the bottleneck
    assert tl.utilization("stream:0") == pytest.approx(6 / 17)


def test_kernel_bound_chain():
    tl = simulate(launch_chain(2.0, 10.0))
    # L1 0-2, L2 2-4, L3 4-6; K1 2-12, K2 12-22, K3 22-32: makespan = 2 + 3*10 = 32
    assert [tl.times[k] for k in ("K1", "K2", "K3")] == [(2, 12), (12, 22), (22, 32)]
    assert tl.makespan_us == 32.0
    assert tl.critical_path == ("L1", "K1", "K2", "K3")       # GPU-bound after the 1st launch
    # per layer: GPU time only (10 each); the CPU launches do not count when there are kernels
    assert tl.per_layer_us == {"layer1": 10.0, "layer2": 10.0, "layer3": 10.0}


def test_two_streams_with_event():
    def build(event):
        g = TaskGraph()
        g.append(Task.cpu("L1", 1))
        g.append(Task.gpu("K1", 10, stream=0), deps=["L1"])
        g.append(Task.cpu("L2", 1))
        g.append(Task.gpu("K2", 15, stream=1), deps=["L2"])
        g.append(Task.cpu("L3", 1))
        g.append(Task.gpu("K3", 3, stream=0), deps=["L3"] + (["K2"] if event else []))
        return g
    g = build(True)
    assert g.dep_kind("K2", "K3") is DepKind.EVENT             # inferred across streams
    tl = simulate(g)
    # L1 0-1, L2 1-2, L3 2-3; K1 1-11 on s0, K2 2-17 on s1 (overlap);
    # K3 waits for K1 (11), the event on K2 (17) and L3 (3): 17-20
    assert tl.times["K2"] == (2.0, 17.0)
    assert tl.times["K3"] == (17.0, 20.0)
    assert tl.makespan_us == 20.0
    assert tl.critical_path == ("L1", "L2", "K2", "K3")
    # without the event K3 runs 11-14 and K2 ends last at 17
    assert simulate(build(False)).makespan_us == 17.0


def test_gpu_to_cpu_sync():
    g = TaskGraph()
    g.append(Task.cpu("L1", 1))
    g.append(Task.gpu("K1", 10), deps=["L1"])
    g.append(Task.sync("S", 1), deps=[("K1", DepKind.SYNC)])
    g.append(Task.cpu("L2", 1))
    g.append(Task.gpu("K2", 2), deps=["L2"])
    tl = simulate(g)
    # L1 0-1, K1 1-11; S waits for K1: 11-12; L2 12-13; K2 13-15
    assert tl.times["S"] == (11.0, 12.0)
    assert tl.times["K2"] == (13.0, 15.0)
    assert tl.makespan_us == 15.0
    assert tl.busy_us["cpu:0"] == 3.0                          # L1 + S + L2
    assert tl.critical_path == ("L1", "K1", "S", "L2", "K2")
    # remove() keeps the order it bridges (K1 -> L2): L2 11-12, K2 12-14
    assert simulate(g.remove("S")).makespan_us == 14.0
    # dropping the sync edge instead: S 1-2, L2 2-3, K2 queues behind K1: 11-13
    assert simulate(g.remove_dep("K1", "S")).makespan_us == 13.0


def test_tie_break_is_insertion_order():
    g = TaskGraph()
    g.add_task(Task.cpu("X", 5))
    g.add_task(Task.cpu("Y", 3))
    # both ready at 0 on cpu:0: X (added first) 0-5, then Y 5-8
    assert simulate(g).times == {"X": (0, 5), "Y": (5, 8)}
    h = TaskGraph()
    h.add_task(Task.cpu("Y", 3))
    h.add_task(Task.cpu("X", 5))
    assert simulate(h).times == {"Y": (0, 3), "X": (3, 8)}     # Y 0-3, X 3-8


def test_tie_break_sees_all_tasks_ready_at_one_instant():
    g = TaskGraph()
    g.add_task(Task.cpu("P1", 5, thread=0))
    g.add_task(Task.cpu("P2", 5, thread=1))
    g.add_task(Task.gpu("C1", 2))
    g.add_task(Task.gpu("C2", 2))
    g.add_dep("P2", "C1")
    g.add_dep("P1", "C2")
    tl = simulate(g)
    # P1 and P2 both end at 5; C1 and C2 both become ready at 5; C1 was added first: 5-7,
    # then C2 7-9 (even though P1's completion is processed before P2's)
    assert tl.times["C1"] == (5.0, 7.0)
    assert tl.times["C2"] == (7.0, 9.0)


@pytest.mark.parametrize("util, expected_end", [
    (1.0, 20.0),   # sum 2 > 1: each at rate 1/2, 10 µs of work takes 20 µs
    (0.5, 10.0),   # sum 1 <= 1: both at full speed
    (0.75, 15.0),  # sum 1.5: rate 2/3, 10 / (2/3) = 15
])
def test_contention_two_concurrent_kernels(util, expected_end):
    g = TaskGraph()
    g.add_task(Task.gpu("A", 10, stream=0, utilization=util))
    g.add_task(Task.gpu("B", 10, stream=1, utilization=util))
    tl = simulate(g, Contention())
    assert tl.times["A"] == pytest.approx((0.0, expected_end))
    assert tl.times["B"] == pytest.approx((0.0, expected_end))
    assert simulate(g).makespan_us == 10.0                    # no contention: free overlap
    # a device with capacity 2 runs both at full speed
    assert simulate(g, Contention(capacity=2.0)).makespan_us == 10.0
    assert simulate(g, Contention(enabled=False)).makespan_us == 10.0


def test_contention_staggered_kernels_recompute_finish_times():
    g = TaskGraph()
    g.add_task(Task.gpu("A", 10, stream=0))
    g.append(Task.cpu("L", 5))
    g.append(Task.gpu("B", 10, stream=1), deps=["L"])
    tl = simulate(g, contention=True)
    # A alone 0-5 (5 µs done); 5-15 both at rate 1/2: A's last 5 µs take 10 -> ends 15;
    # B did 5 µs by 15, its last 5 at full speed -> ends 20
    assert tl.times["A"] == pytest.approx((0.0, 15.0))
    assert tl.times["B"] == pytest.approx((5.0, 20.0))
    assert tl.busy_us["stream:1"] == pytest.approx(15.0)


def test_contention_does_not_slow_cpu_tasks():
    g = TaskGraph()
    g.add_task(Task.gpu("A", 10, stream=0))
    g.add_task(Task.gpu("B", 10, stream=1))
    g.add_task(Task.cpu("C", 10))
    tl = simulate(g, True)
    assert tl.times["C"] == (0.0, 10.0)                        # only GPU kernels share
    assert tl.makespan_us == pytest.approx(20.0)


def test_memory_peak_with_overlapping_allocations():
    g = TaskGraph()
    g.add_task(Task.cpu("A", 10, thread=0, mem_alloc=100, mem_free=100))
    g.append(Task.cpu("C", 5, thread=1))
    g.append(Task.cpu("B", 10, thread=1, mem_alloc=50, mem_free=50))
    tl = simulate(g, initial_memory_bytes=1000)
    # A allocs 100 at 0, B allocs 50 at 5 (overlap), A frees at 10, B frees at 15
    assert tl.memory_curve == ((0, 1000), (0, 1100), (5, 1150), (10, 1050), (15, 1000))
    assert tl.peak_memory_bytes == 1150                        # 1000 + 100 + 50
    # on one thread they do not overlap: peak 1000 + 100
    seq = TaskGraph()
    seq.append(Task.cpu("A", 10, mem_alloc=100, mem_free=100))
    seq.append(Task.cpu("B", 10, mem_alloc=50, mem_free=50))
    assert simulate(seq, initial_memory_bytes=1000).peak_memory_bytes == 1100


def test_memory_kept_across_tasks_and_zero_duration():
    g = TaskGraph()
    g.append(Task.gpu("fw", 4, mem_alloc=300))                # activation kept for bw
    g.append(Task.gpu("ws", 0, mem_alloc=20, mem_free=20))    # zero-length workspace still counts
    g.append(Task.gpu("bw", 4, mem_free=300))
    tl = simulate(g)
    assert tl.peak_memory_bytes == 320                         # 300 + 20 at t=4
    assert tl.memory_curve[-1] == (8.0, 0)                     # all freed when bw ends at 8


def test_empty_and_cpu_only_per_layer():
    tl = simulate(TaskGraph())
    assert (tl.makespan_us, tl.critical_path, tl.peak_memory_bytes) == (0.0, (), 0)
    g = TaskGraph()
    g.append(Task.cpu("a", 3, layer="enc.0"))
    g.append(Task.cpu("b", 4, layer="enc.0"))
    g.append(Task("c", TaskKind.CPU, 5, "cpu:0", fx_node="relu"))  # an op of no layer: the model's own
    g.append(Task("o", TaskKind.CPU, 2, "cpu:0", phase="optim"))    # the optimizer's, apart
    g.append(Task.cpu("gap", 6))                                    # host work around the ops: no row
    assert simulate(g).per_layer_us == {"enc.0": 7.0, "": 5.0, OPTIMIZER_STEP: 2.0}  # CPU time (no kernels)


def test_cycle_is_reported():
    g = TaskGraph()
    g.append(Task.cpu("a", 1))
    g.append(Task.cpu("b", 1))
    g.add_dep("b", "a")
    with pytest.raises(ValueError, match="cycle"):
        simulate(g)
    with pytest.raises(ValueError, match="cycle"):
        simulate(g, Contention())


def test_what_if_primitives_change_makespan():
    g = launch_chain(2.0, 10.0)                                # makespan 32 (see above)
    # K2 at half duration: K2 12-17, K3 17-27
    assert simulate(g.scale("K2", 0.5)).makespan_us == 27.0
    # "GPU 2x faster": kernels 5 µs, still GPU bound: 2 + 3*5 = 17
    assert simulate(g.scale(g.select(kind="gpu"), 0.5)).makespan_us == 17.0
    # insert a 4 µs kernel between K1 and K2 on the stream: 32 + 4 = 36
    ins = g.insert(Task.gpu("X", 4), after="K1", before="K2")
    tl = simulate(ins)
    assert tl.times["X"] == (12.0, 16.0)
    assert tl.makespan_us == 36.0
    # K2 onto stream 1: it only waits for L2 (4) -> 4-14, overlapping K1 2-12;
    # K3 follows K1 on stream 0: 12-22
    moved = g.schedule("K2", "stream:1")
    tl = simulate(moved)
    assert tl.times["K2"] == (4.0, 14.0)
    assert tl.times["K3"] == (12.0, 22.0)
    assert tl.makespan_us == 22.0
    # ... but with contention the device is already saturated: K1 alone 2-4, then shared at
    # 1/2 until K1 ends at 4 + 8/0.5 = 20; K2 has 2 µs left, K3 starts at 20: shared again,
    # K2 ends 24, K3 has 8 left at full speed: 32 = the serial time, no gain
    assert simulate(moved, True).makespan_us == pytest.approx(32.0)
    # keep_deps turns the same-stream edges into events: no overlap, back to 32
    assert simulate(g.schedule("K2", "stream:1", keep_deps=True)).makespan_us == 32.0


def test_remove_in_launch_bound_chain():
    g = launch_chain(5.0, 2.0)
    tl = simulate(g.remove("L2"))
    # L1 0-5, L3 5-10 (L1 -> L3 reconnected); K2 now launched by L1 and after K1: 7-9;
    # K3 after L3: 10-12
    assert tl.times["K2"] == (7.0, 9.0)
    assert tl.makespan_us == 12.0


def test_reorder_on_cpu_thread():
    g = TaskGraph()
    g.append(Task.cpu("A", 5))
    g.append(Task.cpu("B", 5))
    g.append(Task.gpu("KB", 10), deps=["B"])
    # A 0-5, B 5-10, KB 10-20
    assert simulate(g).makespan_us == 20.0
    # launch first: B 0-5, KB 5-15 overlapping A 5-10
    r = g.reorder("B", before="A")
    assert r.names[:2] == ("B", "A")
    assert simulate(r).makespan_us == 15.0


def _reference(g):
    """Independent, naive O(n^2) version of the documented semantics (no heaps)."""
    tasks, names = g.tasks, g.names
    preds = {n: set(g.predecessors(n)) for n in names}
    end, start, running, t = {}, {}, {}, 0.0      # running: resource -> (name, end)
    while len(end) < len(tasks):
        for r in g.resources:
            if r not in running:
                ready = [x for x in tasks if x.resource == r and x.name not in start
                         and all(p in end and end[p] <= t for p in preds[x.name])]
                if ready:                          # tasks are in insertion order
                    x = ready[0]
                    start[x.name] = t
                    running[r] = (x.name, t + x.duration_us)
        t = min(e for _, e in running.values())
        for r, (n, e) in list(running.items()):
            if e == t:
                end[n] = e
                del running[r]
    return {n: (start[n], end[n]) for n in names}


def _random_graph(rng, n):
    g = TaskGraph()
    resources = ["cpu:0", "cpu:1", "stream:0", "stream:1", "comm:0"]
    for i in range(n):
        r = rng.choice(resources)
        kind = {"cpu": "cpu", "stream": "gpu", "comm": "comm"}[r.split(":")[0]]
        deps = rng.sample(g.names, min(len(g), rng.randint(0, 3)))
        g.append(Task(f"t{i}", kind, rng.choice([0, 1, 2, 3, 5, 8]), r,
                      utilization=rng.choice([0.25, 0.5])),
                 deps=deps, after_last_on_resource=rng.random() < 0.7)
    return g


def test_matches_naive_reference_on_random_graphs():
    import random
    rng = random.Random(1234)
    for _ in range(60):
        g = _random_graph(rng, rng.randint(1, 25))
        tl = simulate(g)
        assert dict(tl.times) == _reference(g)
        # utilizations 0.25/0.5 on two streams never sum above 1: contention changes nothing
        assert dict(simulate(g, True).times) == dict(tl.times)
        # the critical path is a chain of back-to-back tasks from time 0 to the makespan
        cp = tl.critical_path
        assert tl.start(cp[0]) == 0.0 and tl.end(cp[-1]) == tl.makespan_us
        for a, b in zip(cp, cp[1:]):
            assert tl.end(a) == tl.start(b)


def _reference_shared(g):
    """Naive processor sharing: step from event to event, all GPU kernels at one shared rate."""
    tasks, names = g.tasks, g.names
    by_name = {t.name: t for t in tasks}
    preds = {n: set(g.predecessors(n)) for n in names}
    end, start, running, rem, t = {}, {}, {}, {}, 0.0
    while len(end) < len(tasks):
        for r in g.resources:
            if r not in running:
                ready = [x for x in tasks if x.resource == r and x.name not in start
                         and all(p in end for p in preds[x.name])]
                if ready:
                    start[ready[0].name], running[r] = t, ready[0].name
                    rem[ready[0].name] = ready[0].duration_us
        u = sum(by_name[n].utilization for n in running.values() if by_name[n].kind == "gpu")
        rate = {n: (1.0 if by_name[n].kind != "gpu" or u <= 1 else 1 / u)
                for n in running.values()}
        dt = min(rem[n] / rate[n] for n in running.values())
        t += dt
        for r, n in list(running.items()):
            rem[n] -= dt * rate[n]
            if rem[n] <= 1e-9:
                end[n] = t
                del running[r]
    return {n: (start[n], end[n]) for n in names}


def test_contention_matches_naive_processor_sharing():
    import random
    rng = random.Random(99)
    for _ in range(40):
        g = _random_graph(rng, rng.randint(2, 20))
        g = g.update(g.select(kind="gpu"), utilization=1.0)   # rates 1 or 1/2: exact floats
        got, want = simulate(g, True).times, _reference_shared(g)
        for n in g.names:
            assert got[n] == pytest.approx(want[n]), n
