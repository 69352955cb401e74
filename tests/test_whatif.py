"""What-if scenarios (fxdream.whatif): hand-computed expectations on tiny graphs and models."""
import dataclasses
import math

import pytest
import torch
from conftest import TwoSubgraphs
from torch import nn

import fxdream
from fxdream import whatif as W
from fxdream.sim import DepKind, Task, TaskGraph
from fxdream.sim.cost.analytic import Analytic
from fxdream.sim.cost.devices import datasheet_device, with_parameters
from fxdream.sim.optimizer_step import ADAM, SGD
from fxdream.sim.prediction import Prediction, predict

H100 = datasheet_device("h100")  # hand-computed from its datasheet figures
MB = 2 ** 20


def kernel_chain(n=3, launch=1.0, kernel=10.0, op="aten.relu"):
    """cpu:0 launches L_i (launch µs), each launching K_i (kernel µs) on stream:0."""
    g = TaskGraph()
    for i in range(n):
        g.append(Task.cpu(f"L{i}", launch, op=op, phase="fw"))
        g.append(Task.gpu(f"K{i}", kernel, op=op, phase="fw"), deps=[f"L{i}"])
    return g


def mlp(widths=(16, 64, 64, 8)):
    torch.manual_seed(0)
    layers = []
    for i, (a, b) in enumerate(zip(widths[:-1], widths[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(widths) - 2:
            layers.append(nn.ReLU())
    return nn.Sequential(*layers)


@pytest.fixture(scope="module")
def captured_mlp():
    model = mlp()
    return model, fxdream.capture(model, (torch.randn(4, 16),), training=True)


@pytest.fixture(scope="module")
def captured_conv():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3), nn.Flatten(),
                          nn.Linear(8 * 6 * 6, 4))
    return model, fxdream.capture(model, (torch.randn(2, 3, 8, 8),), training=True)


def h100_prediction(captured, optimizer=SGD):
    return predict(captured, Analytic(H100), True, optimizer)


# ---- 3. a faster GPU -----------------------------------------------------------------------------
def test_faster_gpu_halves_kernels_and_a_kernel_bound_chain():
    g = kernel_chain()                         # L0 [0,1] K0 [1,11] K1 [11,21] K2 [21,31]
    w = W.faster_gpu(g, 2.0)
    assert w.baseline_ms == pytest.approx(0.031)
    assert w.time_ms == pytest.approx(0.016)   # 1 + 3 * 5
    assert [w.task_graph.task(f"K{i}").duration_us for i in range(3)] == [5.0, 5.0, 5.0]
    assert [w.task_graph.task(f"L{i}").duration_us for i in range(3)] == [1.0, 1.0, 1.0]
    assert "PREDICTED" in w.summary() and w.measured is None
    assert g.task("K0").duration_us == 10.0    # never mutates its input


def test_faster_gpu_on_a_launch_bound_chain_gains_nothing_and_rejects_cpu():
    w = W.faster_gpu(kernel_chain(launch=10.0, kernel=2.0), 4.0)
    assert w.time_ms == pytest.approx(w.baseline_ms - 0.0015)   # only the last kernel shrinks
    cpu_only = TaskGraph()
    cpu_only.append(Task.cpu("a", 5.0))
    with pytest.raises(ValueError, match="no GPU kernel tasks"):
        W.faster_gpu(cpu_only)
    with pytest.raises(ValueError, match="factor"):
        W.faster_gpu(kernel_chain(), 0.0)


# ---- 1. AMP --------------------------------------------------------------------------------------
def test_amp_ratios_on_a_hand_built_graph():
    g = TaskGraph()
    g.append(Task.cpu("L0", 1.0, phase="fw"))
    g.append(Task.gpu("conv", 100.0, op="aten.convolution", phase="fw"), deps=["L0"])
    g.append(Task.cpu("L1", 1.0, phase="fw"))
    g.append(Task.gpu("relu", 10.0, op="aten.relu", phase="fw"), deps=["L1"])
    g.append(Task.cpu("L2", 1.0, phase="fw"))
    g.append(Task.gpu("tiny", 1.2, op="aten.add", phase="fw"), deps=["L2"])
    g.append(Task.cpu("L3", 1.0, phase="fw"))
    g.append(Task.gpu("softmax", 8.0, op="aten._softmax", phase="fw"), deps=["L3"])
    g.append(Task.cpu("O", 1.0, op="optimizer.adam", phase="optim"))
    g.append(Task.gpu("O:k", 20.0, op="optimizer.adam", phase="optim"), deps=["O"])
    w = W.amp(g, H100, "float16")
    d = {t.name: t.duration_us for t in w.task_graph.tasks}
    assert d["conv"] == pytest.approx(100.0 * 67 / 989.4)     # fp32 -> fp16 tensor-core peak
    assert d["relu"] == pytest.approx(5.0)                    # half the bytes
    assert d["tiny"] == pytest.approx(1.2)                    # the device's shortest kernel
    assert d["softmax"] == 8.0 and d["O:k"] == 20.0           # autocast fp32 list; fp32 master weights
    assert w.time_ms < w.baseline_ms
    with pytest.raises(ValueError, match="AMP dtype"):
        W.amp(g, "h100", "int8")
    with pytest.raises(ValueError, match="needs a device"):
        W.amp(g)


def test_amp_rederives_conv_kernels_from_flops_and_bytes(captured_conv):
    _, captured = captured_conv
    base = h100_prediction(captured)
    w = W.amp(base, captured=captured)   # device: the prediction's (h100)
    conv = next(n for n in captured.forward.graph.nodes if "convolution" in str(n.target))
    name = f"g0.fw:{conv.name}:k"
    flops = fxdream.ir.flops.node_flops(conv)
    x, wt, b = (a.meta["val"] for a in conv.args[:3])
    out = conv.meta["val"]
    fp32_bytes = 4 * (x.numel() + wt.numel() + b.numel() + out.numel())
    old = max(flops / 67e12, fp32_bytes / 3.35e12, 1.2e-6)
    casts = 6 * (x.numel() + wt.numel() + b.numel())   # autocast casts input, weight, bias once
    new = max(flops / 989.4e12, (fp32_bytes / 2 + casts) / 3.35e12, 1.2e-6)
    assert base.task_graph.task(name).duration_us == pytest.approx(old * 1e6)
    assert w.task_graph.task(name).duration_us == pytest.approx(new * 1e6)
    assert w.details["amp.from_fx"] == w.details["amp.compute"] + w.details["amp.elementwise"]
    optim = base.task_graph.select(phase="optim", kind="gpu")
    assert all(w.task_graph.task(n).duration_us == base.task_graph.task(n).duration_us for n in optim)


# ---- 2. fused optimizer --------------------------------------------------------------------------
def test_fused_adam_replaces_per_parameter_tasks_with_one_of_the_same_bytes(captured_mlp):
    model, captured = captured_mlp
    base = h100_prediction(captured, ADAM)
    params = list(model.parameters())
    foreach = base.task_graph.select(phase="optim")
    assert len(foreach) == 2 * ADAM.foreach_ops                 # torch's multi-tensor ops: a launch and a kernel each
    w = W.fused_optimizer(base, captured=captured)
    fused = w.task_graph.select(phase="optim")
    assert len(fused) == 2 and w.details["fused.replaced_tasks"] == len(foreach)
    grad_bytes = sum(4 * p.numel() for p in params)
    assert w.details["fused.bytes"] == 7 * grad_bytes          # Adam: p, g, m, v read; p, m, v written
    kernel = w.task_graph.task(fused[1])
    assert kernel.duration_us == pytest.approx(max(7 * grad_bytes / 3.35e12 * 1e6, 1.2))
    assert w.task_graph.task(fused[0]).duration_us == pytest.approx(1.5 + 5.0)  # one launch
    assert w.time_ms < w.baseline_ms
    assert len(w.task_graph) == len(base.task_graph) - len(foreach) + 2


def test_fused_optimizer_without_captured_reads_bytes_from_kernel_times():
    g = kernel_chain(n=1, op="aten.mm")
    for i in range(4):
        g.append(Task.cpu(f"optim:{i}", 5 * 6.5, op="optimizer.adam", phase="optim"))
        g.append(Task.gpu(f"optim:{i}:k", 10.0, op="optimizer.adam", phase="optim"), deps=[f"optim:{i}"])
    w = W.fused_optimizer(g, device=H100)
    kernels = w.task_graph.select(phase="optim", kind="gpu")
    assert len(kernels) == 1 and w.task_graph.task(kernels[0]).duration_us == pytest.approx(40.0)
    # on a spec whose kernels start up (a fitted one), the fused kernel is priced as one kernel
    started = with_parameters(H100, {"kernel_startup_us.other": 3.0})
    w = W.fused_optimizer(g, device=started)
    assert w.task_graph.task(w.task_graph.select(phase="optim", kind="gpu")[0]).duration_us == pytest.approx(43.0)
    with pytest.raises(ValueError, match="no optimizer tasks"):
        W.fused_optimizer(kernel_chain())


# ---- 4. data parallel ----------------------------------------------------------------------------
def test_ring_allreduce_formula_and_cluster_models():
    assert W.ring_allreduce_us(100e6, 4, 10e9, 5.0) == pytest.approx(2 * 3 / 4 * 100e6 / 10e9 * 1e6 + 30)
    assert W.ring_allreduce_us(100e6, 1, 10e9, 5.0) == 0.0
    assert W.ring_allreduce_us(100e6, 8, math.inf, 0.0) == 0.0
    S = 100e6
    c = W.Cluster(2, 8, network_gbps=10, network_latency_us=25, nvlink_GBps=300, nvlink_latency_us=3)
    intra = 2 * 7 / 8 * S / 300e9 * 1e6 + 14 * 3
    inter = 2 * 1 / 2 * S / 1.25e9 * 1e6 + 2 * 25
    assert c.allreduce_us(S) == pytest.approx(intra + inter)
    ring = W.Cluster(2, 8, network_gbps=10, network_latency_us=25, nvlink_GBps=300, topology="ring")
    assert ring.allreduce_us(S) == pytest.approx(2 * 15 / 16 * S / 1.25e9 * 1e6 + 30 * 25)
    assert W.Cluster(1, 8, nvlink_GBps=300, nvlink_latency_us=3).allreduce_us(S) == pytest.approx(intra)
    assert W.Cluster(4, 1, network_gbps=40, network_latency_us=0).allreduce_us(S) == \
        pytest.approx(2 * 3 / 4 * S / 5e9 * 1e6)
    faster = [W.Cluster(2, 8, network_gbps=b).allreduce_us(S) for b in (10, 20, 40)]
    assert faster[0] > faster[1] > faster[2]
    with pytest.raises(ValueError):
        W.Cluster(0, 8)
    with pytest.raises(ValueError, match="topology"):
        W.Cluster(2, 2, topology="tree")


def test_ddp_bucket_assignment_by_hand():
    sizes = [3, 20, 10, 0.7, 0.5]                  # MiB, parameter order
    grads = [W.Gradient(i, int(s * MB), None, None, i) for i, s in enumerate(sizes)]
    buckets = W.ddp_buckets(grads)                 # reverse order; caps 1 MiB then 25 MiB
    assert [[g.index for g in b] for b in buckets] == [[4, 3], [2, 1], [0]]
    ready = {0: 5.0, 1: 1.0, 2: 2.0, 3: 3.0, 4: 4.0}  # production order 1, 2, 3, 4, 0
    assert [[g.index for g in b] for b in W.ddp_buckets(grads, ready_us=ready)] == [[1], [2, 3, 4, 0]]


def test_gradients_map_to_the_backward_tasks_that_produce_them(captured_mlp):
    model, captured = captured_mlp
    base = h100_prediction(captured)
    grads = W.gradients(captured, base.task_graph)
    assert sorted(g.nbytes for g in grads) == sorted(4 * p.numel() for p in model.parameters())
    for g in grads:
        assert g.producer.endswith(":k") and base.task_graph.task(g.producer).phase == "bw"
        assert g.launcher == g.producer[:-2]
        assert g.consumers and all(base.task_graph.task(c).phase == "fw" for c in g.consumers)


def test_ddp_infinite_bandwidth_equals_single_gpu(captured_mlp):
    _, captured = captured_mlp
    base = h100_prediction(captured)
    inf = W.Cluster(2, 8, network_gbps=math.inf, network_latency_us=0, nvlink_GBps=math.inf,
                    nvlink_latency_us=0)
    w = W.ddp(base, inf, captured=captured, copies=False)
    assert w.time_ms == pytest.approx(base.time_ms, abs=1e-12)
    assert w.details["ddp.allreduce_ms_total"] == 0.0
    with_copies = W.ddp(base, inf, captured=captured)      # DDP's scaling/copy-back kernels cost a bit
    assert base.time_ms <= with_copies.time_ms < base.time_ms * 1.2
    assert w.peak_memory_bytes - base.peak_memory_bytes == \
        sum(g.nbytes for g in W.gradients(captured, base.task_graph))   # DDP's bucket buffers


def test_ddp_buckets_overlap_backward_and_the_optimizer_waits(captured_mlp):
    _, captured = captured_mlp
    base = h100_prediction(captured)
    cluster = W.Cluster(2, 1, network_gbps=10, network_latency_us=1)
    w = W.ddp(base, cluster, captured=captured, bucket_cap_mb=0.002, first_bucket_mb=0.002, copies=False)
    g, tl = w.task_graph, w.timeline
    comm = g.select(phase="comm")
    assert len(comm) == w.details["ddp.buckets"] >= 3
    bw_end = max(tl.end(n) for n in g.select(phase="bw"))
    assert tl.start(comm[0]) < bw_end                       # the first bucket goes during backward
    assert all(g.task(n).resource == "comm:0" for n in comm)
    kinds = {g.dep_kind(p, comm[0]) for p in g.predecessors(comm[0])}
    assert DepKind.CPU_TO_COMM in kinds and DepKind.EVENT in kinds
    first_update = g.select(phase="optim", kind="gpu")[0]
    assert tl.start(first_update) >= tl.end(comm[-1])
    for n, gr_bytes in zip(comm, w.details["ddp.bucket_bytes"]):
        assert g.task(n).duration_us == pytest.approx(cluster.allreduce_us(gr_bytes))


def test_ddp_tiny_bandwidth_communication_dominates(captured_mlp):
    _, captured = captured_mlp
    base = h100_prediction(captured)
    w = W.ddp(base, W.Cluster(4, 1, network_gbps=0.001), captured=captured, copies=False)
    comm_ms = w.details["ddp.allreduce_ms_total"]
    assert comm_ms > 50 * base.time_ms
    assert comm_ms <= w.time_ms <= comm_ms + base.time_ms
    rates = [W.ddp(base, W.Cluster(2, 8, network_gbps=b), captured=captured).time_ms for b in (10, 20, 40)]
    assert rates[0] >= rates[1] >= rates[2] >= base.time_ms
    assert W.ddp(base, W.Cluster(2, 8, network_gbps=10)).time_ms == rates[0]  # the prediction's own graphs
    with pytest.raises(ValueError, match="captured"):
        W.ddp(dataclasses.replace(base, captured=None), W.Cluster(2, 1))


def test_a_what_if_carries_the_baseline_range_relative_to_its_time(captured_mlp):
    _, captured = captured_mlp
    base = dataclasses.replace(h100_prediction(captured), range_ms=None)
    low, high = 0.8 * base.time_ms, 1.5 * base.time_ms
    w = W.ddp(dataclasses.replace(base, range_ms=(low, high)), W.Cluster(4, 1, network_gbps=0.001))
    assert w.time_ms_range == pytest.approx((0.8 * w.time_ms, 1.5 * w.time_ms))
    faster = W.faster_gpu(base, 2.0)  # a baseline without a range: none around the scenario either
    assert faster.time_ms_range == pytest.approx((faster.time_ms, faster.time_ms))


def test_ddp_on_a_cpu_device_shares_the_host_when_not_overlapping(captured_mlp):
    _, captured = captured_mlp
    cpu = fxdream.sim.DeviceSpec("cpu-test", "cpu", {"float32": 1e11}, 1e10, 0.0, 1.0, 0.0, None, 0)
    base = predict(captured, Analytic(cpu), True, SGD)
    cluster = W.Cluster(2, 1, network_gbps=1, network_latency_us=10)
    serial = W.ddp(base, cluster, captured=captured, copies=False)          # default on a CPU
    assert serial.details["ddp.overlap"] is False
    comm = serial.task_graph.select(phase="comm")
    assert all(serial.task_graph.task(n).resource == "cpu:0" for n in comm)
    assert serial.time_ms == pytest.approx(base.time_ms + serial.details["ddp.allreduce_ms_total"])
    overlap = W.ddp(base, cluster, captured=captured, copies=False, overlap=True)
    assert overlap.time_ms <= serial.time_ms


def test_expected_max_of_normals_by_hand():
    assert W.expected_max_of_normals(1) == 0.0
    assert W.expected_max_of_normals(2) == pytest.approx(1 / math.sqrt(math.pi), rel=1e-6)
    assert W.expected_max_of_normals(3) == pytest.approx(3 / (2 * math.sqrt(math.pi)), rel=1e-6)
    with pytest.raises(ValueError, match="n must be >= 1"):
        W.expected_max_of_normals(0)


def test_ddp_waits_for_the_slowest_rank(captured_mlp):
    """The simulated rank becomes the slowest: its backward runs σ·E[max of N normals] longer.
    With communication on the host (CPU device) the whole step gets that much longer; with it
    overlapped on a GPU, at most that much."""
    _, captured = captured_mlp
    cpu = fxdream.sim.DeviceSpec("cpu-test", "cpu", {"float32": 1e11}, 1e10, 0.0, 1.0, 0.0, None, 0)
    for base in (predict(captured, Analytic(cpu), True, SGD), h100_prediction(captured)):
        for n in (2, 4):
            cluster = W.Cluster(n, 1, network_gbps=1, network_latency_us=10)
            kw = dict(captured=captured, bucket_cap_mb=0.002, first_bucket_mb=0.002)
            steady = W.ddp(base, cluster, **kw)
            jittery = W.ddp(base, cluster, step_jitter_ms=2.0, **kw)
            wait_ms = 2.0 * W.expected_max_of_normals(n)
            assert jittery.details["ddp.wait_slowest_rank_ms"] == pytest.approx(wait_ms)
            last_comm = jittery.task_graph.select(phase="comm", op="ddp.allreduce")[-1]
            assert "ddp:slowest_rank" in jittery.task_graph.predecessors(last_comm)
            if base.device.kind == "cpu":
                assert jittery.time_ms == pytest.approx(steady.time_ms + wait_ms)
            else:
                assert steady.time_ms < jittery.time_ms <= steady.time_ms + wait_ms + 1e-9
    assert "ddp:slowest_rank" not in steady.task_graph
    with pytest.raises(ValueError, match="step_jitter_ms"):
        W.ddp(base, cluster, captured=captured, step_jitter_ms=-1.0)


@pytest.mark.parametrize("call, error, message", [
    (lambda base, cap: W.p3(base, W.Cluster(2, 1), captured=cap, slice_bytes=0), ValueError,
     "slice_bytes must be a number of bytes >= 1, got 0"),
    (lambda base, cap: W.ddp(base, W.Cluster(2, 1), captured=cap, bucket_cap_mb=-1), ValueError,
     "bucket_cap_mb must be a number of MiB > 0, got -1"),
    (lambda base, cap: W.ddp(base, 8, captured=cap), TypeError, "cluster must be a fxdream.whatif.Cluster"),
    (lambda base, cap: W.Cluster(1.5, 8), TypeError, "machines must be an integer, got 1.5"),
    (lambda base, cap: W.Cluster(2, 8, network_gbps="10"), TypeError, "network_gbps must be a number"),
    (lambda base, cap: W.faster_gpu(base, "2"), ValueError, "factor must be a finite number > 0, got '2'"),
])
def test_bad_what_if_arguments_get_one_line_and_never_a_hang(captured_mlp, call, error, message):
    _, captured = captured_mlp
    with pytest.raises(error, match=message):
        call(h100_prediction(captured), captured)


# ---- P3 ------------------------------------------------------------------------------------------
def test_p3_updates_each_parameter_alone_even_where_the_multi_tensor_step_has_as_many_ops(captured_mlp):
    # Adam's multi-tensor step is 7 ops whatever the parameters; the MLP has 6: read as one op per
    # parameter, P3's window dropped updates and predicted two GPUs faster than one with no network
    _, captured = captured_mlp
    base = h100_prediction(captured, ADAM)
    parameters = len(W.gradients(captured, base.task_graph))
    assert len(base.task_graph.select(phase="optim")) // 2 == ADAM.foreach_ops > parameters
    inf = W.Cluster(2, 1, network_gbps=math.inf, network_latency_us=0)
    same = W.p3(base, inf, captured=captured, slice_bytes=4096)
    per_parameter = h100_prediction(captured, dataclasses.replace(ADAM, foreach=False))
    assert same.time_ms == pytest.approx(per_parameter.time_ms, rel=1e-9)


def test_p3_lets_the_next_forward_start_before_all_gradients_arrive(captured_mlp):
    _, captured = captured_mlp
    base = h100_prediction(captured)
    inf = W.Cluster(2, 1, network_gbps=math.inf, network_latency_us=0)
    same = W.p3(base, inf, captured=captured, slice_bytes=4096)
    # steady state = one iteration whose optimizer updates each parameter on its own, as P3 does
    per_parameter = h100_prediction(captured, dataclasses.replace(SGD, foreach=False))
    assert per_parameter.time_ms > base.time_ms
    assert same.time_ms == pytest.approx(per_parameter.time_ms, rel=1e-9)
    assert same.details["p3.ddp_period_ms (same window)"] == pytest.approx(base.time_ms, rel=0.05)
    # a network where communication is about as long as one iteration's compute
    grad_bytes = sum(g.nbytes for g in W.gradients(captured, base.task_graph))
    gbps = grad_bytes * 8 / (base.time_ms * 1e-3) / 1e9
    net = W.Cluster(2, 1, network_gbps=gbps, network_latency_us=0)
    w = W.p3(base, net, captured=captured, slice_bytes=4096)
    ddp_window = W.ddp_period(base, net, captured=captured)
    assert w.details["p3.ddp_period_ms (same window)"] == pytest.approx(ddp_window.time_ms)
    assert w.time_ms < ddp_window.time_ms
    g = w.task_graph
    slices = g.select(phase="comm")
    assert len(slices) == w.details["p3.slices"] > 3
    # no chain on the channel: priority (insertion order) decides among ready slices
    assert not any(g.task(p).resource == "comm:0" for s in slices for p in g.predecessors(s))
    # the slice of the first layer's gradient is inserted first: the highest priority
    grads = W.gradients(captured, base.task_graph)
    position = {n: i for i, n in enumerate(base.task_graph.names)}
    first = min(grads, key=lambda gr: min(position[c] for c in gr.consumers))
    assert first.launcher in g.predecessors(slices[0]) and first.producer in g.predecessors(slices[0])
    # iteration 2's first forward kernel waits for that parameter's update, not for all slices
    update = f"it2:optim:{first.index}:k"
    assert any(p in slices for p in g.predecessors(update))
    assert w.timeline.start(f"it2:{first.consumers[0]}") < max(w.timeline.end(n) for n in slices)


def test_whatifs_chain_and_report(captured_mlp):
    _, captured = captured_mlp
    base = h100_prediction(captured, ADAM)
    w = W.faster_gpu(W.fused_optimizer(base, captured=captured), 2.0)
    assert w.scenario == "fused adam + 2x faster GPU"
    assert w.baseline is not None and w.baseline.time_ms == pytest.approx(base.time_ms)
    assert w.time_ms <= W.fused_optimizer(base, captured=captured).time_ms
    d = w.to_dict()
    assert d["predicted_ms"] == w.time_ms and "measured" not in d
    m = W.Measured(10.0, 8.0, "test")
    assert w.with_measurement(m).to_dict()["measured"]["speedup"] == pytest.approx(1.25)
    assert "MEASURED" in w.with_measurement(m).summary()
    assert isinstance(w.predicted, Prediction)


# ---- measurements on this CPU --------------------------------------------------------------------
def test_measure_fused_adam_cpu_times_both_and_leaves_the_model():
    model = mlp()
    before = [p.detach().clone() for p in model.parameters()]
    m = W.measure_fused_adam_cpu(model, rounds=2, block=2)
    assert m.baseline_ms > 0 and m.scenario_ms > 0 and "fused=True" in m.how
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert all(p.grad is None for p in model.parameters())


def test_measure_amp_cpu_and_cpu_amp_prediction_with_per_op_ratios(captured_mlp):
    model, captured = captured_mlp
    before = [p.detach().clone() for p in model.parameters()]
    m = W.measure_amp_cpu(model, (torch.randn(4, 16),), rounds=1, block=1)
    assert m.baseline_ms > 0 and m.scenario_ms > 0 and "autocast bfloat16" in m.how
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    cpu = fxdream.sim.DeviceSpec("cpu-test", "cpu", {"float32": 1e11}, 1e10, 0.0, 1.0, 0.0, None, 0)
    base = predict(captured, Analytic(cpu), True, SGD)
    w = W.amp(base, captured=captured, dtype="bfloat16")        # ratios micro-benchmarked here
    assert w.details["amp.measured"] == w.details["amp.from_fx"] > 0
    assert "measured per op" in w.details["amp.rates"]
    assert w.with_measurement(m).measured is m


def test_ddp_and_fused_optimizer_see_only_parameter_gradients_across_a_graph_break():
    model, inputs = TwoSubgraphs(), (torch.randn(3, 4),)
    captured = fxdream.capture(model, inputs, training=True)
    pred = fxdream.simulate(model, inputs, device="h100", training=True, cost="analytic")
    grads = W.gradients(captured, pred.task_graph)
    assert len(grads) == 4  # the second subgraph's gradient of its activation input is no parameter's
    assert sum(g.nbytes for g in grads) == sum(p.numel() * 4 for p in model.parameters())
    fused = W.fused_optimizer(pred, captured=captured)
    # SGD with momentum moves 5 bytes per gradient byte: one pass over p, g, buf (read) and p, buf (written)
    assert fused.details["fused.bytes"] == 5 * sum(g.nbytes for g in grads)
    assert fused.details["fused.replaced_tasks"] == 2 * 3  # SGD's three multi-tensor ops: a launch and a kernel each


def test_what_ifs_count_every_call_of_a_graph_called_per_layer():
    """A block with a graph break inside, four times: its graphs run four times per step, each
    call with its own layer's parameters and gradients."""
    from test_host_gaps import _Blocks

    from fxdream.simulation import capture_for_prediction, prediction_inputs
    from fxdream.whatif.gradients import gradients
    model, x = _Blocks(4), torch.randn(8, 32)
    to_capture, inputs, cost = prediction_inputs(model, (x,), "h100", "auto")
    _, captured, step, _ = capture_for_prediction((model, (x,)), to_capture, inputs, training=True)
    base = predict(captured, cost, True, SGD, step=step)
    parameter_bytes = sum(p.numel() * 4 for p in model.parameters())
    grads = gradients(captured, base.task_graph)
    assert len(grads) == 16 and sum(g.nbytes for g in grads) == parameter_bytes  # 4 blocks x 2 linears x (w, b)
    assert len({g.producer for g in grads}) == 16  # each produced by its own call's task
    fused = W.fused_optimizer(base, captured=captured)
    assert fused.details["fused.bytes"] == SGD.bytes_per_grad_byte * parameter_bytes
    # AMP finds the node of every call's task: four blocks' worth, not one block's
    amp = W.amp(base, dtype="float16", captured=captured)
    one_block = _Blocks(1)
    to_capture, inputs, cost = prediction_inputs(one_block, (x,), "h100", "auto")
    _, captured, step, _ = capture_for_prediction((one_block, (x,)), to_capture, inputs, training=True)
    amp_one = W.amp(predict(captured, cost, True, SGD, step=step), dtype="float16", captured=captured)
    assert amp.details["amp.from_fx"] >= 4 * amp_one.details["amp.from_fx"]  # (the graphs split blocks unevenly)


def test_a_window_period_is_compared_with_one_gpus_period_in_the_same_window(captured_mlp):
    """A steady-state period overlaps the host's start-up with the step before; the baseline's
    one step pays it: one rank with no network must read 1.0x, not faster than one GPU."""
    _, captured = captured_mlp
    base = h100_prediction(captured, SGD)
    for what_if in (W.ddp_period(base, W.Cluster(1, 1), captured=captured),
                    W.p3(base, W.Cluster(1, 1), captured=captured, slice_bytes=4096)):
        assert what_if.baseline_ms == what_if.details["one GPU's period ms (same window)"]
    alone = W.ddp_period(base, W.Cluster(1, 1), captured=captured)
    assert alone.predicted_speedup == pytest.approx(1.0)
    slow = W.ddp_period(base, W.Cluster(2, 1, network_gbps=0.1), captured=captured)
    assert slow.predicted_speedup < 1.0
