"""The README's tutorial pass works as documented."""
import importlib.util
from pathlib import Path

import torch

import fxdream
from fxdream import models


def _load_example():
    path = Path(__file__).parents[1] / "examples" / "gelu_tanh.py"
    spec = importlib.util.spec_from_file_location("gelu_tanh_example", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gelu_tanh_example_rewrites_bert_and_stays_close():
    _load_example()
    assert "gelu_tanh" in fxdream.available_passes()
    model, inputs, _ = models.build("bert_base", 2, tiny=True)
    model.eval()
    optimized = fxdream.optimize(model, inputs, passes=["gelu_tanh"], cost="analytic")
    (row,) = optimized.report.passes
    assert row.applied and row.reason == "2 GELU(s) now use the tanh form"
    assert row.notes == ("bert.encoder.layer.0.intermediate.intermediate_act_fn",
                         "bert.encoder.layer.1.intermediate.intermediate_act_fn")
    with torch.no_grad():
        torch.testing.assert_close(optimized(*inputs), model(*inputs), atol=1e-3, rtol=1e-3)
