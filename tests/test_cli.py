"""python -m fxdream: each subcommand on a tiny zoo model, and its one-line errors."""
import json
import re

import pytest
import torch

from fxdream.cli import main


def test_simulate_with_passes_for_a_gpu_writes_trace_and_plot(tmp_path, capsys):
    trace, plot = tmp_path / "t.json", tmp_path / "t.png"
    assert main(["simulate", "mnist_convnet", "--tiny", "--device", "h100", "--pass", "cuda_graphs",
                 "--trace", str(trace), "--plot", str(plot)]) == 0
    out = capsys.readouterr().out
    assert "predicted inference on h100" in out and "cuda_graphs [0/fw] applied" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert any("cuda_graph" in e.get("name", "") for e in events)  # the one graph launch
    assert plot.stat().st_size > 0


def test_whatif_prints_every_scenario(tmp_path, capsys):
    out_json = tmp_path / "w.json"
    assert main(["whatif", "mnist_convnet", "--tiny", "--batch", "2", "--device", "h100",
                 "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    for scenario in ("AMP float16", "fused adam", "2x faster GPU", "DDP 2x8 @ 10 Gbps", "P3 2x8 @ 40 Gbps"):
        assert f"| {scenario}" in out
    saved = json.loads(out_json.read_text())
    assert saved["device"] == "h100" and len(saved["scenarios"]) == 10
    # twice the GPU speed cannot give more than twice the speed
    (faster,) = [s for s in saved["scenarios"] if s["name"] == "2x faster GPU"]
    assert 1.0 < faster["predicted_speedup"] <= 2.0


def test_explain_for_a_gpu_lists_each_pass(tmp_path, capsys):
    stem = tmp_path / "e"
    assert main(["explain", "resnet18", "--tiny", "--batch", "2", "--device", "h100", "--out", str(stem)]) == 0
    out = capsys.readouterr().out
    for name in ("fuse_conv_bias_act", "cuda_graphs", "aux_stream_backward"):
        assert name in out
    assert (tmp_path / "e.trace.json").exists() and (tmp_path / "e.png").exists()


@pytest.mark.parametrize("argv, message", [
    (["simulate", "resnet1000"], "unknown model 'resnet1000'"),
    (["ab", "mynet.py", "--pass", "reinplace"], "unknown model 'mynet.py' (a model of your own: mynet.py:FUNCTION)"),
    (["ab", "mnist_convnet", "--tiny", "--pass", "x", "--load", "/no/such/passes.py"],
     "--load '/no/such/passes.py': no such file"),
    (["simulate", "mnist_convnet", "--tiny", "--trace", "/no/such/folder/t.json"], "no folder '/no/such/folder'"),
    (["ab", "mnist_convnet", "--tiny", "--pass", "fuse_everything"], "fuse_everything"),
    (["ab", "mnist_convnet", "--tiny", "--pass", "cuda_graphs", "--device", "h100"], "an A/B measures on this machine"),
    pytest.param(["ab", "mnist_convnet", "--tiny", "--pass", "cuda_graphs", "--device", "cuda"], "no CUDA device here",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is here")),
])
def test_bad_arguments_give_one_line(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err



@pytest.mark.parametrize("argv, message", [
    (["ab", "mnist_convnet", "--tiny", "--pass", "fuse_conv_bias_act", "--batch", "1,0"], "--batch: 0 must be at least 1"),
    (["ab", "mnist_convnet", "--tiny", "--pass", "fuse_conv_bias_act", "--batch", ","], "no batch size given"),
    (["ab", "mnist_convnet", "--tiny", "--pass", "fuse_conv_bias_act", "--rounds", "two"], "'two' is not an integer"),
    (["simulate", "mnist_convnet", "--tiny", "--batch", "-2"], "--batch: -2 must be at least 1"),
    (["simulate", "mnist_convnet", "--tiny", "--top", "-1"], "--top: -1 must be at least 1"),
    (["explain", "mnist_convnet", "--top", "0"], "--top: 0 must be at least 1"),
    (["simulate", "mnist_convnet", "--tiny", "--device", "tpu9"], "argument --device: unknown device 'tpu9'"),
])
def test_counts_below_one_are_refused_by_argparse(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_ab_refuses_bad_batch_sizes_rounds_and_blocks():
    import fxdream
    for kwargs, message in (({"batch_sizes": [8, 0]}, r"batch_sizes must be integers ≥ 1, got \(8, 0\)"),
                            ({"rounds": 0}, "rounds must be an integer ≥ 1, got 0"),
                            ({"block": 2.5}, "block must be an integer ≥ 1, got 2.5")):
        with pytest.raises(ValueError, match=message):
            fxdream.ab("mnist_convnet", ["fuse_conv_bias_act"], tiny=True, **kwargs)


@pytest.mark.parametrize("spec, stem", [("resnet50", "resnet50"), ("nets/my.net.py:build", "nets_my_net_build"),
                                        ("pkg.models:make", "pkg_models_make")])
def test_a_model_spec_becomes_a_plain_file_name(spec, stem):
    from fxdream.cli_arguments import file_safe
    assert file_safe(spec) == stem

def test_demo_on_a_tiny_model_reports_and_times(capsys):
    assert main(["demo", "--model", "mnist_convnet", "--tiny", "--rounds", "1", "--block", "1"]) == 0
    out, err = capsys.readouterr()
    assert "## fxdream report" in out and "| auto |" in out
    assert "fxdream: building MnistConvNet (inference, cpu, passes: auto) ..." in err  # progress, on stderr
    assert "fxdream: pass fuse_conv_bias_act on 0/fw:" in err and "fxdream: built MnistConvNet in" in err
    assert "fxdream:" not in out
    assert "fxdream, auto" in out and "rebuilt in" in out
    diff = float(out.split("max abs diff of the outputs vs eager: ")[1].split(")")[0])
    assert diff < 1e-4
    assert re.search(r"measured gain of the passes: [\d.]+x, (inside|outside) the build's predicted [\d.]+x "
                     r"\([\d.]+–[\d.]+\)", out)


def test_quiet_leaves_stderr_without_progress_lines_and_the_logger_as_it_was(capsys):
    import logging
    log = logging.getLogger("fxdream")
    handlers, level = list(log.handlers), log.level
    assert main(["-q", "capture", "mnist_convnet", "--tiny"]) == 0
    assert main(["ab", "mnist_convnet", "--tiny", "--pass", "reinplace", "--batch", "1", "--rounds", "1",
                 "--block", "1"]) == 0
    err = capsys.readouterr().err
    assert "fxdream: building" in err
    assert main(["-q", "ab", "mnist_convnet", "--tiny", "--pass", "reinplace", "--batch", "1", "--rounds", "1",
                 "--block", "1"]) == 0
    assert "fxdream: building" not in capsys.readouterr().err
    assert log.handlers == handlers and log.level == level


USER_MODEL = '''
import torch, torch.nn as nn

def build(batch):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 8 * 8, 4))
    return model, torch.randn(batch, 3, 8, 8)

def raises(batch):
    raise ValueError("no such size")


def not_a_pair(batch):
    return 42

class Mine(nn.Linear):
    pass

def build_mine(batch):
    return Mine(4, 2), torch.randn(batch, 4)

class MaskedSum(nn.Module):
    """Boolean-mask indexing: nonzero, which the meta device cannot answer."""
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x, mask):
        return self.linear(x).squeeze(-1)[mask == 1].sum()

def build_on_meta(batch):
    with torch.device("meta"):
        model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Flatten())
    return model, torch.randn(batch, 3, 8, 8, device="meta")

def build_masked(batch):
    return MaskedSum(), dict(x=torch.randn(batch, 12, 8), mask=torch.ones(batch, 12, dtype=torch.long))
'''


def test_a_model_file_is_importable_by_its_module_name(tmp_path):
    """inductor imports a model class's module by name: a file loaded as a user model must be
    in sys.modules (it was not, and torch.compile failed on it with ModuleNotFoundError)."""
    import importlib
    from fxdream.cli_arguments import user_model
    path = tmp_path / "mine.py"
    path.write_text(USER_MODEL)
    model, inputs, _ = user_model(f"{path}:build_mine")(2)
    assert importlib.import_module(type(model).__module__).Mine is type(model)


def test_your_own_model_from_a_file_in_ab_simulate_and_explain(tmp_path, capsys):
    path = tmp_path / "mine.py"
    path.write_text(USER_MODEL)
    out_json = tmp_path / "ab.json"
    assert main(["ab", f"{path}:build", "--pass", "fuse_conv_bias_act", "--batch", "2", "--training",
                 "--rounds", "1", "--block", "1", "--json", str(out_json)]) == 0
    (row,) = json.loads(out_json.read_text())["rows"]
    assert row["model"] == "build" and row["batch"] == 2 and row["training"]
    assert row["max_abs_diff"] < 1e-4
    assert main(["simulate", f"{path}:build", "--device", "h100", "--batch", "4"]) == 0
    assert "predicted inference on h100" in capsys.readouterr().out
    assert main(["explain", f"{path}:build", "--device", "h100", "--out", str(tmp_path / "e")]) == 0


def test_explain_and_whatif_for_a_gpu_capture_a_value_reading_model_on_its_data(tmp_path, capsys):
    """A model that reads tensor values has no meta capture: explain and whatif capture it on
    the example's data, as simulate does, and say so (they failed with the meta error)."""
    path = tmp_path / "mine.py"
    path.write_text(USER_MODEL)
    assert main(["explain", f"{path}:build_masked", "--device", "h100", "--training", "--batch", "2",
                 "--out", str(tmp_path / "e")]) == 0
    explained = capsys.readouterr().out
    assert "note: captured on the example's data here, not on the meta device" in explained
    assert main(["simulate", f"{path}:build_masked", "--device", "h100", "--training", "--batch", "2"]) == 0
    simulated = re.search(r"predicted training step on h100: ([0-9.]+) ms", capsys.readouterr().out).group(1)
    # explain's step includes the optimizer step, as simulate's does
    assert f"predicted on h100: {simulated} ms without passes" in explained
    assert main(["whatif", f"{path}:build_masked", "--device", "h100", "--batch", "2"]) == 0
    assert "note: captured on the example's data here" in capsys.readouterr().out


@pytest.mark.parametrize("spec,message", [
    ("{path}:missing", "has no function 'missing'"),
    ("{path}:not_a_pair", "not_a_pair(1) must return (model, inputs) or (model, inputs, loss_fn), got int"),
    ("/no/such/file.py:build", "no file '/no/such/file.py'"),
    ("no_such_module_xyz:build", "No module named 'no_such_module_xyz'"),
    (":build", "model ':build': give FILE.py:FUNCTION or MODULE:FUNCTION"),
    ("{path}:raises", "raises(1) raised ValueError: no such size"),
])
def test_a_bad_model_spec_gives_one_line(tmp_path, capsys, spec, message):
    path = tmp_path / "mine.py"
    path.write_text(USER_MODEL)
    assert main(["simulate", spec.format(path=path), "--device", "h100"]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


def test_simulate_takes_a_training_step_without_an_optimizer(capsys):
    tasks = {}
    for optimizer in ("none", "sgd"):
        assert main(["simulate", "mnist_convnet", "--tiny", "--training", "--device", "h100",
                     "--optimizer", optimizer]) == 0
        first = capsys.readouterr().out.splitlines()[1]
        tasks[optimizer] = int(first.rsplit("(", 1)[1].split()[0])
    assert tasks["none"] < tasks["sgd"]  # no optimizer step's tasks
    assert main(["simulate", "mnist_convnet", "--tiny", "--training", "--device", "h100"]) == 0
    assert int(capsys.readouterr().out.splitlines()[1].rsplit("(", 1)[1].split()[0]) == tasks["sgd"]  # the default


@pytest.mark.parametrize("command", ["simulate", "explain"])
def test_an_optimizer_for_an_inference_prediction_is_refused_not_ignored(command, capsys):
    assert main([command, "mnist_convnet", "--tiny", "--device", "h100", "--optimizer", "adam"]) == 2
    assert "add --training" in capsys.readouterr().err


def test_a_model_built_on_the_meta_device_is_predicted_and_not_measured(tmp_path, capsys):
    path = tmp_path / "mine.py"
    path.write_text(USER_MODEL)
    assert main(["simulate", f"{path}:build_on_meta", "--device", "h100", "--batch", "2", "--training"]) == 0
    assert "predicted training step on h100" in capsys.readouterr().out
    assert main(["whatif", f"{path}:build_on_meta", "--batch", "2"]) == 0
    assert "baseline (predicted)" in capsys.readouterr().out
    assert main(["ab", f"{path}:build_on_meta", "--pass", "reinplace"]) == 2
    assert "the model is on the meta device (shapes, no data), and an A/B runs it here" in capsys.readouterr().err
