"""Measurements taken while other processes ran are said in the report, the decisions made on
them are marked, and strict=True builds again, then raises."""
import contextlib

import pytest
import torch
import torch.nn as nn

import fxdream
import fxdream.build as build
import fxdream.simulation as simulation
from fxdream.sim.profile.machine_load import LoadWatch, foreign_cpu_seconds, watch_machine_load


def _busy_machine(cores: float):
    @contextlib.contextmanager
    def watch():
        yield LoadWatch(foreign_cpu_s=cores * 2.0, window_s=2.0)
    return watch


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU()).eval(), torch.randn(1, 3, 12, 12)


def test_a_build_on_a_busy_machine_says_so_and_marks_its_decisions(monkeypatch):
    monkeypatch.setattr(build, "watch_machine_load", _busy_machine(1.0))
    model, x = _net()
    report = fxdream.optimize(model, (x,), passes="auto").report
    assert report.measurements_disturbed.startswith("other processes kept 1.00 core(s) busy")
    decided = [r for r in report.passes if r.name == "auto" or r.predicted_delta_us is not None]
    assert decided and all(r.reason.endswith("[decided on measurements taken while the machine was busy]")
                           for r in decided)
    assert "**Measurements disturbed**" in report.to_markdown()


def test_a_quiet_machine_leaves_the_report_as_it_was(monkeypatch):
    monkeypatch.setattr(build, "watch_machine_load", _busy_machine(0.1))
    model, x = _net()
    report = fxdream.optimize(model, (x,), passes="auto").report
    assert report.measurements_disturbed is None
    assert not any("while the machine was busy" in r.reason for r in report.passes)


def test_strict_builds_again_then_raises(monkeypatch):
    monkeypatch.setattr(build, "watch_machine_load", _busy_machine(1.0))
    builds, real_build = [], build._build
    monkeypatch.setattr(build, "_build", lambda *a: builds.append(a[2]) or real_build(*a))
    model, x = _net()
    with pytest.raises(fxdream.CaptureError, match="measurements were disturbed 2 times"):
        fxdream.optimize(model, (x,), passes=["fuse_conv_bias_act"], strict=True)
    assert len([passes for passes in builds if passes]) == 2  # (the graph-call probe builds without passes)


def test_other_processes_cpu_time_counts_and_this_process_tree_does_not():
    before = {1: (0, 100), 50: (1, 10)}
    after = {1: (0, 300), 50: (1, 10), 60: (1, 50)}  # pid 1 ran 200 ticks, a new process 50
    assert foreign_cpu_seconds(before, after) == pytest.approx(250 / __import__("os").sysconf("SC_CLK_TCK"))
    with watch_machine_load() as watch:
        pass
    assert watch.window_s >= 0.0 and (watch.foreign_cpu_s is None or watch.foreign_cpu_s >= 0.0)
    assert not LoadWatch().disturbed and LoadWatch(None, 1.0).cores is None


@pytest.mark.parametrize("cores", [1.0, 0.1])
def test_a_prediction_measured_on_a_busy_machine_says_so(monkeypatch, cores):
    monkeypatch.setattr(simulation, "watch_machine_load", _busy_machine(cores))
    model, x = _net()
    measured = fxdream.simulate(model, (x,))
    disturbed = [n for n in measured.notes if n.startswith("measurements disturbed")]
    assert len(disturbed) == (cores > 0.25)
    if disturbed:
        assert "other processes kept 1.00 core(s) busy while this prediction measured" in disturbed[0]
    analytic = fxdream.simulate(model, (x,), device="h100")  # nothing measured: nothing to disturb
    assert not any(n.startswith("measurements disturbed") for n in analytic.notes)


@pytest.mark.parametrize("argv", [["explain", "mnist_convnet", "--tiny", "--device", "cpu", "--out"],
                                  ["whatif", "mnist_convnet", "--tiny", "--device", "cpu", "--cost", "profiled"]])
def test_the_cli_says_when_costs_it_measured_here_were_disturbed(argv, monkeypatch, tmp_path, capsys):
    import fxdream.cli as cli
    monkeypatch.setattr(cli, "watch_machine_load", _busy_machine(1.0))
    argv = [*argv, str(tmp_path / "out")] if argv[-1] == "--out" else argv
    assert cli.main(argv) == 0
    assert "note: measurements disturbed: other processes kept 1.00 core(s) busy" in capsys.readouterr().out


def test_a_cpu_calibration_on_a_busy_machine_is_tried_again_then_said_in_the_prediction(monkeypatch):
    import fxdream.sim.cost.devices as devices
    monkeypatch.setattr(devices, "_CPU_CACHE", {})  # this process's calibration is left as it was
    monkeypatch.setattr(devices, "watch_machine_load", _busy_machine(1.0))
    calibrations = []
    measure = devices._calibrated
    monkeypatch.setattr(devices, "_calibrated", lambda seconds: calibrations.append(seconds) or measure(seconds))
    spec = devices.calibrate_cpu(seconds=0.05)
    assert len(calibrations) == 3 and spec.calibration_disturbed.startswith("other processes kept 1.00 core(s) busy "
                                                                           "while this calibration measured")
    assert devices.calibrate_cpu() is spec  # kept, not measured on every read
    model, x = _net()
    prediction = fxdream.simulate(model, (x,), device="cpu", cost="analytic")
    assert any(n.startswith("this CPU's calibration (peak FLOP/s, bandwidth) disturbed: other processes kept 1.00 "
                            "core(s) busy") for n in prediction.notes)


def test_a_cpu_calibration_quiet_on_its_second_try_is_that_one(monkeypatch):
    import fxdream.sim.cost.devices as devices
    monkeypatch.setattr(devices, "_CPU_CACHE", {})
    loads = iter([_busy_machine(1.0), _busy_machine(0.0)])
    monkeypatch.setattr(devices, "watch_machine_load", lambda: next(loads)())
    assert devices.calibrate_cpu(seconds=0.05).calibration_disturbed is None


@pytest.mark.parametrize("cores", [1.0, 0.1])
def test_costs_measured_on_a_busy_machine_are_not_kept_for_later_ones(monkeypatch, cores):
    """A later prediction or build in the process would reuse them (the store of measured
    costs), and read the busy machine again on a quiet one."""
    from fxdream.sim.profile import store
    model, x = _net()
    monkeypatch.setattr(simulation, "watch_machine_load", _busy_machine(cores))
    store.forget_profiles()
    fxdream.simulate(model, (x,))
    assert bool(store._STORES) == (cores < 0.25)
    monkeypatch.setattr(build, "watch_machine_load", _busy_machine(cores))
    store.forget_profiles()
    fxdream.optimize(model, (x,), passes="auto")
    assert bool(store._STORES) == (cores < 0.25)
