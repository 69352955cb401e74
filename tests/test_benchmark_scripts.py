"""The benchmark scripts run end to end on a small model (they are not timed here: their
figures come from real runs). A script whose imports rot skips every case silently, so
these runs assert that rows come out, correct, with the files the README points to."""
import importlib.util
import json
import pathlib
import sys

import pytest
import torch

import fxdream
from fxdream import models
from fxdream.ir.nodes import is_view
from fxdream.passes.fuse_conv_bias_act import sites as conv_sites

BENCHMARKS = pathlib.Path(__file__).resolve().parents[1] / "benchmarks"


def _script(name: str):
    """The script as a module, imported with benchmarks/ on the path (as when it runs)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
        sys.path.remove(str(BENCHMARKS))
    return module


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCHMARKS.glob("*.py")))
def test_every_benchmark_script_imports_and_says_what_it_measures(name, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # as when the script runs
    # relu_only is a plugin that clears the fused activations: let it clear a copy
    monkeypatch.setattr(conv_sites, "INFERENCE_ACTS", dict(conv_sites.INFERENCE_ACTS))
    assert (_script(name).__doc__ or "").strip()


def test_cpu_ab_times_every_runner_and_marks_inference_only_peers_in_training(tmp_path):
    pytest.importorskip("matplotlib")
    cpu_ab = _script("cpu_ab")
    out = str(tmp_path / "ab")
    assert cpu_ab.main(["--models", "mnist_convnet", "--batches", "2", "--training", "--rounds", "2",
                        "--block", "1", "--no-rebuild",
                        "--runners", "eager,fxdream,inductor_freezing,optimize_for_inference",
                        "--out", out]) == 0
    case, = json.loads(pathlib.Path(out + ".json").read_text())["cases"]
    assert case["training"] is True
    runners = case["runners"]
    assert runners["inductor_freezing"] == {"error": "inference only"}
    assert runners["optimize_for_inference"] == {"error": "inference only"}
    fast = runners["fxdream"]
    assert fast["max_abs_diff"] < 1e-4  # outputs and every parameter's gradient
    assert fast["ran_eagerly"] is False  # named passes: no eager check
    assert fast["median_ms"] > 0 and fast["predicted_interleaved_ms"] > 0
    assert pathlib.Path(out + ".png").stat().st_size > 0
    assert "| mnist_convnet | 2 | train | inductor_freezing | not run: inference only |" in \
        pathlib.Path(out + ".md").read_text()


def test_cpu_ab_table_says_when_fxdream_runs_eagerly():
    case = dict(model="m", batch=8, training=True, runners={
        "fxdream": dict(median_ms=2.0, speedup_vs_eager=1.0, build_s=0.5, max_abs_diff=0.0, ran_eagerly=True)})
    assert "| m | 8 | train | fxdream (runs eagerly: eager check) | 2.00 | 1.00x |" in _script("cpu_ab").to_markdown([case])


def test_cpu_ab_inference_runs_the_inference_peer(tmp_path):
    cpu_ab = _script("cpu_ab")
    out = str(tmp_path / "ab")
    assert cpu_ab.main(["--models", "mnist_convnet", "--batches", "1", "--rounds", "2", "--block", "1",
                        "--no-rebuild", "--no-plot", "--runners", "eager,optimize_for_inference",
                        "--out", out]) == 0
    result = json.loads(pathlib.Path(out + ".json").read_text())
    assert result["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    case, = result["cases"]
    peer = case["runners"]["optimize_for_inference"]
    assert peer["max_abs_diff"] < 1e-4 and peer["speedup_vs_eager"] > 0


def test_cpu_ab_refuses_an_unknown_runner_before_building_anything(capsys):
    with pytest.raises(SystemExit):
        _script("cpu_ab").main(["--runners", "eager,freezing"])
    assert "unknown runner(s) freezing; valid: eager, fxdream," in capsys.readouterr().err


def test_fidelity_measures_and_predicts_each_case(tmp_path):
    pytest.importorskip("matplotlib")
    fidelity = _script("fidelity")
    out = str(tmp_path / "fid")
    assert fidelity.main(["--models", "mnist_convnet", "--batches", "2", "--modes", "infer,train",
                          "--rounds", "2", "--out", out]) == 0
    result = json.loads(pathlib.Path(out + ".json").read_text())
    assert result["skipped"] == []
    assert [r["training"] for r in result["rows"]] == [False, True]
    for row in result["rows"]:
        assert row["measured_ms"] > 0 and row["predicted_ms"] > 0
        low, high = row["predicted_range_ms"]
        assert low <= row["predicted_ms"] <= high and row["in_range"] == (low <= row["measured_ms"] <= high)
    assert "coverage: the measured time inside the predicted range in " in pathlib.Path(out + ".md").read_text()


def test_build_fidelity_puts_the_reports_predictions_beside_the_measured_modules(tmp_path):
    build_fidelity = _script("build_fidelity")
    out = str(tmp_path / "build")
    assert build_fidelity.main(["--models", "mnist_convnet", "--batches", "2", "--modes", "infer",
                                "--rounds", "2", "--out", out]) == 0
    (row,) = json.loads(pathlib.Path(out + ".json").read_text())["rows"]
    measured, predicted = row["measured_optimized_ms"], row["predicted_optimized_ms"]
    assert row["optimized_error_pct"] == pytest.approx(100 * (predicted / measured - 1))
    # every pass row's verdict, so a choice can be explained after the run
    assert {r["name"] for r in row["pass_rows"]} >= {"auto", *row["chosen"]}
    applied = {r["name"] for r in row["pass_rows"] if r["applied"] and r["name"] != "auto"}
    assert applied == set(row["chosen"])
    low, high = row["predicted_optimized_range_ms"]
    assert low <= predicted <= high and row["optimized_in_range"] == (low <= measured <= high)
    assert row["measured_gain"] == pytest.approx(row["measured_baseline_ms"] / measured)
    drift = row["measured_eager_ms"] / row["eager_around_build_ms"]
    assert row["machine_drift"] == pytest.approx(drift)
    assert row["optimized_error_at_build_speed_pct"] == pytest.approx(100 * (predicted * drift / measured - 1))
    table = pathlib.Path(out + ".md").read_text()
    assert "infer: gain prediction mean |error|" in table and f"| {drift:.2f}x |" in table
    assert "infer: optimized prediction at the build's machine speed mean |error|" in table


def test_memory_check_puts_the_predicted_peak_beside_the_measured_one(tmp_path):
    memory_check = _script("memory_check")
    out = str(tmp_path / "memory")
    assert memory_check.main(["--models", "mnist_convnet", "--batches", "2", "--modes", "infer,train",
                              "--out", out]) == 0
    infer, train = json.loads(pathlib.Path(out + ".json").read_text())["rows"]
    assert infer["training"] is False and infer["measured_peak_mib"] > 0
    assert infer["error_pct"] == pytest.approx(100 * (infer["predicted_peak_mib"] / infer["measured_peak_mib"] - 1))
    assert train["training"] is True and train["allocated_peak_mib"] > 0  # training is checked on allocations
    assert train["error_pct"] == pytest.approx(100 * (train["predicted_peak_mib"] / train["allocated_peak_mib"] - 1))
    table = pathlib.Path(out + ".md").read_text()
    assert "inference: mean |error|" in table and "training: mean |error|" in table


def test_fidelity_fails_when_every_case_is_skipped(tmp_path, capsys):
    fidelity = _script("fidelity")
    assert fidelity.main(["--models", "no_such_model", "--batches", "1", "--modes", "infer",
                          "--out", str(tmp_path / "fid")]) == 1
    assert "every case was skipped" in capsys.readouterr().err


def test_a_peer_that_dynamo_ran_eagerly_is_an_error_not_a_row(monkeypatch):
    """Past dynamo's recompile limit a compiled copy runs eagerly, silently: cpu_ab must say so."""
    import torch
    from fxdream import models
    cpu_ab = _script("cpu_ab")
    model, inputs, _ = models.build("mnist_convnet", 1, tiny=True)
    model.eval()
    cpu_ab.compile_inductor(model, inputs, freezing=False)  # fills the class's cache entry
    monkeypatch.setattr(cpu_ab, "PEER_RECOMPILE_LIMIT", 1)
    with torch._dynamo.config.patch(recompile_limit=1), \
            pytest.raises(RuntimeError, match="dynamo compiled no graph"):
        cpu_ab.compile_inductor(model, inputs, freezing=False)


def test_isolated_cases_survive_a_crash_and_a_hang(tmp_path):
    """Each case in its own process: one that dies or hangs is reported, the next still runs."""
    isolated = _script("isolated")
    child = tmp_path / "child.py"
    child.write_text(
        "import json, sys, time\n"
        "case, out = sys.argv[sys.argv.index('--case') + 1], sys.argv[sys.argv.index('--case-out') + 1]\n"
        "print('running', case, sys.argv[1])\n"
        "if case == 'crash': sys.exit(3)\n"
        "if case == 'hang': time.sleep(30)\n"
        "if case != 'silent': json.dump(['case', {'name': case}], open(out, 'w'))\n")
    logged = []
    got = list(isolated.run_isolated(["a", "crash", "hang", "silent", "b"], str(child), ["--flag"], timeout_s=3,
                                     log=logged.append))
    assert [(case, result) for case, result, _ in got] == [
        ("a", ["case", {"name": "a"}]), ("crash", None), ("hang", None), ("silent", None), ("b", ["case", {"name": "b"}])]
    why = {case: reason for case, _, reason in got}
    assert why["crash"].startswith("the case's process exited with 3: running crash --flag")
    assert why["hang"].startswith("no result within 3 s") and why["silent"].startswith("the case wrote no result")
    assert "  | running b --flag" in logged
    assert list(isolated.run_isolated(["late"], str(child), [], timeout_s=3, budget_s=-1))[0][2].startswith(
        "time budget spent")


def test_gpu_aux_stream_smoke_runs_on_cpu(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    out = tmp_path / "aux.json"
    assert _script("gpu_aux_stream").main(["--device", "cpu", "--tiny", "--batches", "2", "--dtypes", "fp32",
                                           "--rounds", "2", "--block", "2", "--out", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert "error" not in row and row["peak_delta_pct"] is None and row["max_grad_abs_diff"] == 0.0


def test_gpu_ab_runs_each_case_in_a_child_and_records_a_crash(tmp_path, monkeypatch):
    """The parent plans the cases and starts one child per case; a child's row comes back as a
    case, a child that died as a skipped case with its reason (no GPU needed: CUDA is faked)."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    gpu_ab = _script("gpu_ab")
    monkeypatch.setattr(gpu_ab.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_ab.torch.cuda, "get_device_name", lambda *a: "NVIDIA Fake")
    monkeypatch.setattr(gpu_ab, "run_case", lambda model, dtype, batch, runners, peer, rounds, block: dict(
        model=model, dtype=dtype, batch=batch, peer=peer, runners={}, skipped={}))
    child_out = tmp_path / "child.json"  # the child's side, in this process
    assert gpu_ab.main(["--case", "resnet50:fp16:1", "--case-out", str(child_out)]) == 0
    kind, row = json.loads(child_out.read_text())
    assert kind == "case" and row["peer"] is True and row["batch"] == 1

    started = []

    def fake_children(names, script, passed, timeout_s, budget_s, log):
        for name in names:
            started.append(name)
            if name.startswith("bert_base"):
                yield name, None, "the case's process exited with -11: an illegal memory access"
            else:
                yield name, ["case", dict(model=name.split(":")[0], runners={}, skipped={})], None
    monkeypatch.setattr(gpu_ab, "run_isolated", fake_children)
    out = tmp_path / "ab.json"
    assert gpu_ab.main(["--models", "resnet50,bert_base", "--batches", "1", "--dtypes", "fp16",
                        "--no-overhead", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert started == ["resnet50:fp16:1", "bert_base:fp16:1"]
    assert [c["model"] for c in result["cases"]] == ["resnet50"]
    (skipped,) = result["skipped_cases"]
    assert skipped["model"] == "bert_base" and skipped["batch"] == 1 and "illegal memory access" in skipped["reason"]


def test_whole_ops_times_each_op_eager_captured_and_decomposed(tmp_path, monkeypatch):
    import torch
    import torch.nn.functional as F
    from fxdream.ops import keep_whole as rnn_op
    whole_ops = _script("whole_ops")
    small = {"bilinear 2x": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), torch.randn(1, 2, 4, 4)),
             "max_pool1d 3/2": (lambda x: F.max_pool1d(x, 3, 2), torch.randn(1, 2, 9))}
    monkeypatch.setattr(whole_ops, "cases", lambda: small)
    redirects = dict(rnn_op._REDIRECTS)
    out = tmp_path / "whole.json"
    whole_ops.main(["--decomposed", "--rounds", "1", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["op"] for r in rows] == list(small)
    assert all(r["eager_ms"] > 0 and r["captured_ms"] > 0 and r["decomposed_ms"] > 0 for r in rows)
    assert rnn_op._REDIRECTS == redirects  # the decomposed build put the redirections back
    assert torch.is_grad_enabled()  # and the script left grad mode as it was


def test_gpu_op_profile_records_each_distinct_op_once_with_its_roofline_inputs(tmp_path):
    profile = _script("gpu_op_profile")
    out = tmp_path / "ops.json"
    assert profile.main(["--device", "cpu", "--models", "mnist_convnet", "--batches", "2", "--dtypes", "fp32",
                         "--tiny", "--out", str(out)]) == 0
    records = json.loads(out.read_text())["records"]
    assert len({(r["case"], r["key"]) for r in records}) == len(records)  # each op key once per case
    # each record counts the nodes sharing its key: together, every compute node of the case's graphs
    model, inputs, _ = models.build("mnist_convnet", 2, tiny=True)
    captured = fxdream.capture(model.eval(), inputs)
    nodes = [n for _, gm in captured.graphs() for n in gm.graph.nodes if n.op == "call_function" and not is_view(n)]
    infer = [r for r in records if r["case"].endswith("infer")]
    assert all(r["count"] >= 1 for r in records) and sum(r["count"] for r in infer) == len(nodes)
    assert {r["case"] for r in records} == {"mnist_convnet fp32 bs2 infer", "mnist_convnet fp32 bs2 train"}
    convs = [r for r in records if r["op"] == "aten.convolution"]
    assert convs and all(r["class"] in ("conv", "conv_1x1") and r["flops"] > 0 and r["kernel_us"] > 0 for r in convs)
    assert any(r["op"] == "aten.convolution_backward" and r["phase"] == "bw" for r in records)
    assert all(r["host_us"] is None for r in records)  # on a CPU host and kernel are one time


def test_fit_gpu_model_reads_the_committed_lease_results(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    sections = _script("fit_gpu_model")._diag_sections()
    assert sections["hf_bert bs128"]["eager_device_ms"] == 7.020
    assert sections["bert_base bs1"]["capture_ms"] == 12.479 and sections["bert_base bs1"]["capture_device_ms"] == 0.679


def test_a_missing_peer_is_a_row_that_says_how_to_install_it(monkeypatch):
    peers = _script("cpu_peers")

    def missing(name):
        raise ImportError(f"No module named {name!r}")
    monkeypatch.setattr(peers.importlib, "import_module", missing)
    model = torch.nn.Linear(3, 2)
    for name in peers.PEERS:
        with pytest.raises(peers.PeerUnavailable, match=r"is not installed \(pip install '\.\[peers\]'\)"):
            peers.build_peer(name, model, (torch.randn(1, 3),))
    with pytest.raises(ValueError, match="unknown peer 'tvm'; valid: onnxruntime, openvino_f32, openvino"):
        peers.build_peer("tvm", model, (torch.randn(1, 3),))


@pytest.mark.parametrize("name", ["onnxruntime", "openvino_f32"])
def test_an_installed_peer_runs_the_model_at_fp32(name):
    pytest.importorskip("onnxruntime" if name == "onnxruntime" else "openvino")
    if name == "onnxruntime":
        pytest.importorskip("onnxscript")
    peers = _script("cpu_peers")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(), torch.nn.Linear(64, 5))
    x = torch.randn(2, 3, 6, 6)
    run = peers.build_peer(name, model.eval(), (x,))
    with torch.no_grad():
        torch.testing.assert_close(run(x), model(x), atol=1e-5, rtol=1e-5)


def test_cpu_peer_profile_groups_each_engines_op_names_into_the_same_kinds():
    kind_of = _script("cpu_peer_profile").kind_of
    expected = {"convolution": ["fxdream.conv_fused_inference", "aten.convolution", "Conv", "Convolution"],
                "pooling": ["aten.max_pool2d_with_indices", "MaxPool"],
                "matmul / linear": ["aten.addmm", "Gemm", "FullyConnected", "inner_product"],
                "reorder / copy": ["Reorder", "aten._to_copy", "aten.copy_", "Convert"],
                "elementwise": ["aten.relu", "Add", "aten.div_", "binary"],  # oneDNN's primitive kind
                "normalization": ["aten.native_layer_norm", "MVN"],
                "other": ["ReduceMean", "aten.mean", "aten.view"]}
    assert {name: kind_of(name) for names in expected.values() for name in names} == {
        name: kind for kind, names in expected.items() for name in names}


def test_cpu_ab_lists_a_missing_engine_as_not_run_with_the_install_hint(tmp_path, monkeypatch):
    cpu_ab = _script("cpu_ab")

    def missing(name, model, inputs):
        raise cpu_ab.PeerUnavailable(f"{name} is not installed (pip install '.[peers]'): no module")
    monkeypatch.setattr(cpu_ab, "build_peer", missing)
    out = str(tmp_path / "ab")
    assert cpu_ab.main(["--models", "mnist_convnet", "--batches", "1", "--rounds", "1", "--block", "1",
                        "--no-rebuild", "--no-plot", "--runners", "eager,onnxruntime", "--out", out]) == 0
    assert "| mnist_convnet | 1 | infer | onnxruntime | not run: onnxruntime is not installed (pip install " \
           "'.[peers]'): no module |" in pathlib.Path(out + ".md").read_text()


def test_fit_gpu_model_takes_kernel_and_host_costs_from_per_op_records(tmp_path, monkeypatch):
    """Records made by a known spec (convolutions: 5 µs startup, 40 % of the roofline; host:
    dispatch 1.5 µs + launch 20.5 µs, x3 for a convolution): the fit finds the startup and the
    share again from the records, takes the host cost per class as a ratio of medians, and
    checks the held-out model's records and every host time."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    fit = _script("fit_gpu_model")
    from fxdream.sim.cost.devices import datasheet_device, with_parameters
    truth = with_parameters(datasheet_device("h200"), {"kernel_startup_us.conv": 5.0, "roofline_share.conv": 0.4,
                                                       "launch_overhead_us": 20.5, "host_factor.conv": 3.0})
    records = []
    for model in ("resnet50", "bert_base"):
        ops = [("aten.relu", "other", 0)] + [("aten.convolution", "conv", f) for f in (1e6, 1e9, 1e10, 2e10, 4e10,
                                                                                       6e10, 8e10, 1e11)]
        for i, (op, kind, flops) in enumerate(ops):
            nbytes = 4e6 * (i + 1)
            kernel_us = truth.kernel_time_us(flops, nbytes, "float16", kind)
            records.append({"case": f"{model} fp16 bs8 infer", "op": op, "class": kind, "dtype": "float16",
                            "flops": flops, "bytes": nbytes, "kernel_us": kernel_us, "in_graph_us": None,
                            "host_us": truth.host_us(kind), "key": "k"})
    path = tmp_path / "ops.json"
    path.write_text(json.dumps({"records": records}))
    out = tmp_path / "fit.json"
    assert fit.main(["--no-models", "--ops", str(path), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    # within the grid's steps: 0.25 µs of startup, 5 % of share
    assert report["parameters"]["kernel_startup_us.conv"] == pytest.approx(5.0, abs=0.3)
    assert report["parameters"]["roofline_share.conv"] == pytest.approx(0.4, rel=0.03)
    assert "roofline_share.other" not in report["parameters"]  # no long pointwise kernels: the datasheet's
    # (1.5 + 3 x 20.5) / (1.5 + 20.5): the records' ratio, taken as measured
    assert report["parameters"]["host_factor.conv"] == pytest.approx(63.0 / 22.0, rel=1e-3)
    held = report["per_op_held_out"]
    assert held["aten.convolution kernel"]["cases"] == 8 and held["aten.relu host"]["cases"] == 2
    assert held["aten.convolution host"]["cases"] == 16  # every model's host times are checked, none fitted
    assert all(row["fitted_median_abs_error_pct"] < 3 for kind, row in held.items() if kind.endswith("kernel"))
    assert held["aten.convolution kernel"]["datasheet_median_abs_error_pct"] > 50


def test_fit_gpu_model_recovers_each_class_startup_and_share(tmp_path, monkeypatch):
    """Kernel records made by a known kernel model (convolutions: 8 µs startup per kernel, 40 %
    of the roofline; pointwise: 1.5 µs, 90 %; the datasheet's 1.2 µs floor below both), from tiny
    to long kernels: each class's grid fit lands near its startup and share, and the joint fit
    from there on them."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    fit = _script("fit_gpu_model")
    from fxdream.sim.cost.devices import datasheet_device, with_parameters
    sheet = datasheet_device("h200")
    values = {"kernel_startup_us.conv": 8.0, "roofline_share.conv": 0.4,
              "kernel_startup_us.other": 1.5, "roofline_share.other": 0.9}
    truth = with_parameters(sheet, values)
    records = []
    for i, work in enumerate((1e-3, 1e-2, 0.1, 1.0, 10.0, 20.0, 50.0, 100.0, 200.0)):  # roofline µs at fp16
        conv = {"op": "aten.convolution", "class": "conv", "flops": work * 989.4e6, "bytes": 0.0}
        relu = {"op": "aten.relu", "class": "other", "flops": 0, "bytes": work * 4.8e6}
        for r in (conv, relu):
            r.update(case=f"resnet50 fp16 bs{i} infer", dtype="float16", key="k", in_graph_us=None, host_us=None)
            r["kernel_us"] = truth.kernel_time_us(r["flops"], r["bytes"], "float16", r["class"])
            records.append(r)
    start = _script("gpu_op_records").class_kernel_models(sheet, records)
    for name, value in values.items():
        assert start[name] == pytest.approx(value, rel=0.05), name
    path, out = tmp_path / "ops.json", tmp_path / "fit.json"
    path.write_text(json.dumps({"records": records}))
    assert fit.main(["--no-models", "--ops", str(path), "--out", str(out), "--parameters",
                     ",".join(values)]) == 0
    fitted = json.loads(out.read_text())["parameters"]
    for name, value in values.items():
        assert fitted[name] == pytest.approx(value, rel=0.03), name


def test_fit_gpu_model_takes_a_class_the_fit_model_lacks_from_the_held_out_records(tmp_path, monkeypatch):
    """The fit model's GEMMs are all short, the held-out model's long ones ran at 60 % of the
    roofline: the held-out GEMM records set the class's share (not checked: reported apart), and
    the fit says so; the held-out model's other records stay checked."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    fit = _script("fit_gpu_model")
    from fxdream.sim.cost.devices import datasheet_device, with_parameters
    truth = with_parameters(datasheet_device("h200"), {"kernel_startup_us.gemm": 4.0, "roofline_share.gemm": 0.6})
    records = []
    for model, works in (("resnet50", (1e-3, 1e-2, 0.1)), ("bert_base", (1e-2, 1.0, 20.0, 40.0, 80.0, 120.0, 160.0))):
        for i, work in enumerate(works):  # roofline µs at fp16
            for op, kind, flops, nbytes in (("aten.addmm", "gemm", work * 989.4e6, 0.0),
                                            ("aten.relu", "other", 0, 4e6)):
                records.append({"case": f"{model} fp16 bs{i} infer", "op": op, "class": kind, "dtype": "float16",
                                "flops": flops, "bytes": nbytes, "in_graph_us": None, "host_us": None, "key": "k",
                                "kernel_us": truth.kernel_time_us(flops, nbytes, "float16", kind)})
    path, out = tmp_path / "ops.json", tmp_path / "fit.json"
    path.write_text(json.dumps({"records": records}))
    assert fit.main(["--no-models", "--ops", str(path), "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["parameters"]["roofline_share.gemm"] == pytest.approx(0.6, rel=0.03)
    assert list(report["borrowed_classes"]) == ["gemm"]
    assert report["per_op_fit"]["aten.addmm kernel"]["cases"] == 3  # the fit model's
    assert report["per_op_borrowed"]["aten.addmm kernel"]["cases"] == 7  # the held-out model's: used, not checked
    assert report["per_op_borrowed"]["aten.addmm kernel"]["fitted_median_abs_error_pct"] < 3
    assert "aten.addmm kernel" not in report["per_op_held_out"]
    assert report["per_op_held_out"]["aten.relu kernel"]["cases"] == 7  # the held-out model's others: checked
