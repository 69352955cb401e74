"""TaskGraph building, validation and the what-if primitives (structure; makespans are in
test_sim_simulate.py)."""
import pytest

from fxdream.sim import DepKind, Task, TaskGraph, TaskKind, infer_dep_kind, simulate


def chain():
    """cpu:0: L1 L2 L3 launching K1 K2 K3 on stream:0."""
    g = TaskGraph()
    for i in (1, 2, 3):
        g.append(Task.cpu(f"L{i}", 2, layer=f"enc.{i}", op="launch", phase="fw"))
        g.append(Task.gpu(f"K{i}", 10, layer=f"enc.{i}", op="aten.mm", phase="fw"),
                 deps=[f"L{i}"])
    return g


def test_task_validation_and_helpers():
    t = Task.gpu("k", 3, stream=1, layer="a.b")
    assert (t.kind, t.resource, t.duration_us, t.utilization) == (TaskKind.GPU, "stream:1",
                                                                  3.0, 1.0)
    assert Task("x", "comm", 1, "comm:0").kind is TaskKind.COMM      # str kinds are coerced
    assert Task.sync("s").resource == "cpu:0"
    for bad in (dict(duration_us=-1), dict(duration_us=float("nan")), dict(utilization=0.0),
                dict(utilization=1.5), dict(mem_alloc=-1), dict(name=""), dict(kind="tpu")):
        kw = dict(name="a", kind="gpu", duration_us=1, resource="stream:0") | bad
        with pytest.raises(ValueError):
            Task(**kw)
    with pytest.raises(Exception):
        t.duration_us = 5  # frozen


def test_append_infers_dep_kinds():
    g = chain()
    assert g.dep_kind("L1", "L2") is DepKind.CPU_SEQUENTIAL
    assert g.dep_kind("K1", "K2") is DepKind.GPU_SAME_STREAM
    assert g.dep_kind("L1", "K1") is DepKind.LAUNCH
    assert g.names == ("L1", "K1", "L2", "K2", "L3", "K3")          # insertion order
    assert [t.name for t in g.tasks] == list(g.names)
    assert len(g) == 6 and len(g.deps) == 7                          # 2 + 2 + 3 launches


def test_neighbours_in_resource_order_skip_other_resources():
    g = chain()
    assert (g.next_on_resource("L1"), g.previous_on_resource("L1")) == ("L2", None)
    assert (g.next_on_resource("K2"), g.previous_on_resource("K2")) == ("K3", "K1")  # not L2 (a launch)
    assert g.next_on_resource("K3") is None
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        g.next_on_resource("nope")
    assert g.predecessors("K2") == ("K1", "L2")
    assert set(g.successors("L1")) == {"K1", "L2"}
    assert g.resources == ("cpu:0", "stream:0")
    assert g.last_on("stream:0") == "K3"


def test_infer_dep_kind_table():
    c0, c1, s0, s1 = Task.cpu("c0", 1), Task.cpu("c1", 1, 1), Task.gpu("s0", 1), Task.gpu("s1", 1, 1)
    n, y = Task.comm("n", 1), Task.sync("y")
    assert infer_dep_kind(c0, y) is DepKind.CPU_SEQUENTIAL
    assert infer_dep_kind(c0, c1) is DepKind.THREAD_TO_THREAD
    assert infer_dep_kind(c0, s0) is DepKind.LAUNCH
    assert infer_dep_kind(s0, s1) is DepKind.EVENT
    assert infer_dep_kind(s0, y) is DepKind.SYNC
    assert infer_dep_kind(c0, n) is DepKind.CPU_TO_COMM
    assert infer_dep_kind(n, s0) is DepKind.EVENT


def test_errors_duplicate_unknown_self():
    g = chain()
    with pytest.raises(ValueError, match="duplicate task name 'K1'"):
        g.add_task(Task.gpu("K1", 1))
    with pytest.raises(ValueError, match="unknown task 'nope'"):
        g.add_dep("K1", "nope")
    with pytest.raises(ValueError, match="unknown task"):
        g.task("nope")
    with pytest.raises(ValueError, match="self-dependency"):
        g.add_dep("K1", "K1")
    with pytest.raises(ValueError, match="unknown task"):
        g.scale("nope", 2)
    with pytest.raises(ValueError, match="no dependency"):
        g.dep_kind("K1", "L1")


def test_cycle_detected_at_simulate_time():
    g = chain()
    g.add_dep("K3", "L1")                                            # allowed while building
    with pytest.raises(ValueError, match="cycle: .*L1"):
        g.validate()
    with pytest.raises(ValueError, match="cycle"):
        simulate(g)


def test_copy_is_independent():
    g = chain()
    h = g.copy()
    h.append(Task.cpu("L4", 1))
    assert len(g) == 6 and len(h) == 7
    assert simulate(g).makespan_us == 32.0                           # 2 + 3 * 10


def test_select_filters():
    g = chain()
    g.append(Task.gpu("X", 1, stream=1, layer="encoder", op="aten.mm.default", phase="bw"))
    assert g.select(kind="gpu") == ("K1", "K2", "K3", "X")
    assert g.select(layer="enc") == ("L1", "K1", "L2", "K2", "L3", "K3")  # not "encoder"
    assert g.select(layer="enc.2") == ("L2", "K2")
    assert g.select(op="aten.mm") == ("K1", "K2", "K3", "X")         # dotted prefix
    assert g.select(resource="stream") == ("K1", "K2", "K3", "X")
    assert g.select(resource="stream:1") == ("X",)
    assert g.select(phase="bw") == ("X",)
    assert g.select(lambda t: t.duration_us > 5, layer="enc.3") == ("K3",)
    assert g.select() == g.names


def test_scale_and_update_return_new_graphs():
    g = chain()
    h = g.scale(g.select(kind=TaskKind.GPU), 0.5)
    assert h.task("K1").duration_us == 5.0 and g.task("K1").duration_us == 10.0
    assert g.shrink("K1", 0.5).task("K1").duration_us == 5.0        # alias of scale
    assert h.deps == g.deps
    with pytest.raises(ValueError):
        g.scale("K1", -1)
    u = g.update(["K1", "K2"], utilization=0.5)
    assert u.task("K2").utilization == 0.5 and g.task("K2").utilization == 1.0
    with pytest.raises(ValueError):
        g.update("K1", name="other")


def test_remove_reconnects():
    g = chain()
    r = g.remove("K2")
    assert "K2" not in r and "K2" in g
    assert r.dep_kind("K1", "K3") is DepKind.GPU_SAME_STREAM         # stream order bridged
    assert r.dep_kind("L2", "K3") is DepKind.LAUNCH                  # L2 -> K2 -> K3 kept
    r2 = g.remove(["L2", "K2"])
    assert r2.dep_kind("L1", "L3") is DepKind.CPU_SEQUENTIAL
    assert r2.names == ("L1", "K1", "L3", "K3")
    assert r2.last_on("stream:0") == "K3"


def test_insert_between_and_order():
    g = chain()
    h = g.insert(Task.gpu("X", 4), after="K1", before="K2")
    assert h.names == ("L1", "K1", "X", "L2", "K2", "L3", "K3")      # right after K1
    assert h.dep_kind("K1", "X") is DepKind.GPU_SAME_STREAM
    assert h.dep_kind("X", "K2") is DepKind.GPU_SAME_STREAM
    assert "K2" not in h.successors("K1")                            # chain stays a chain
    c = g.insert(Task.comm("AR", 7), after="K3", kind=DepKind.EVENT)
    assert c.dep_kind("K3", "AR") is DepKind.EVENT
    assert simulate(c).makespan_us == 39.0                           # 32 + 7 after K3


def test_schedule_moves_and_rewires():
    g = chain()
    s = g.schedule("K2", "stream:1")
    assert s.task("K2").resource == "stream:1"
    assert s.dep_kind("K1", "K3") is DepKind.GPU_SAME_STREAM         # old stream bridged
    assert set(s.predecessors("K2")) == {"L2"}                       # keeps its launch only
    k = g.schedule("K2", "stream:1", keep_deps=True)
    assert k.dep_kind("K1", "K2") is DepKind.EVENT                   # same order, by events
    assert k.dep_kind("K2", "K3") is DepKind.EVENT
    # placing it in another stream's chain
    g.append(Task.gpu("A", 1, stream=1))
    a = g.schedule("K1", "stream:1", after="A")
    assert a.dep_kind("A", "K1") is DepKind.GPU_SAME_STREAM
    assert a.names.index("K1") == a.names.index("A") + 1


def test_reorder_rewires_chain_and_rejects_cycles():
    g = chain()
    r = g.reorder("K3", before="K2")
    assert r.dep_kind("K1", "K3") is DepKind.GPU_SAME_STREAM
    assert r.dep_kind("K3", "K2") is DepKind.GPU_SAME_STREAM
    assert "K3" not in r.successors("K2")
    tl = simulate(r)
    # L3 ends at 6, K1 2-12, then K3 12-22, K2 22-32
    assert tl.times["K3"] == (12.0, 22.0) and tl.times["K2"] == (22.0, 32.0)
    assert g.reorder("K1", after="K3").names[-1] == "K1"
    with pytest.raises(ValueError, match="exactly one"):
        g.reorder("K1")
    with pytest.raises(ValueError, match="runs on"):
        g.reorder("K1", after="L1")
    # K1 -> L2 -> K2: putting K2 before K1 on the stream would close a cycle
    h = chain()
    h.add_dep("K1", "L2")
    with pytest.raises(ValueError, match="cycle"):
        h.reorder("K2", before="K1")


def test_builder_keeps_sim_arrays_in_sync():
    g = chain()
    before = simulate(g)                                             # arrays now exist
    g.append(Task.cpu("L4", 1))
    g.add_dep("K3", "L4")
    g.add_dep("K3", "L4", DepKind.SYNC)                              # same edge: kind updated
    tl = simulate(g)
    assert g.dep_kind("K3", "L4") is DepKind.SYNC
    assert tl.times["L4"] == (32.0, 33.0)                            # after K3 (22-32)
    assert len(before.times) == 6 and "L4" not in before.times       # old result unchanged
    s = g.scale("K1", 0.5)                                           # clone + in-place update
    s.append(Task.gpu("K4", 1), deps=["L4"])
    assert "K4" not in g and g.task("K1").duration_us == 10.0
    # K1 2-7, K2 7-17, K3 17-27, L4 waits for K3: 27-28, K4 28-29
    assert simulate(s).makespan_us == 29.0
    assert simulate(g).makespan_us == 33.0                           # original untouched
