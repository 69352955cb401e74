"""The repo's per-pass A/B benchmarks: ``pytest -m ab`` (a plain run skips them).

Each times eager, the capture and the capture with one pass, interleaved, with the
predictions beside (tables in the terminal summary; ``--fxdream-ab-json=PATH`` keeps them),
and fails only when the pass changes the results beyond rounding: timings are not asserted."""
import pathlib
import runpy

import pytest

pytestmark = pytest.mark.ab


def test_fuse_conv_bias_act_inference(fxdream_ab):
    fxdream_ab("resnet18", passes=["fuse_conv_bias_act"], batch_sizes=(1, 8))
    fxdream_ab("mnist_convnet", passes=["fuse_conv_bias_act"], batch_sizes=(1, 8, 32))


def test_fuse_conv_bias_act_training(fxdream_ab):
    fxdream_ab("mnist_convnet", passes=["fuse_conv_bias_act"], batch_sizes=(8, 32), training=True)


def test_fuse_attention_inference(fxdream_ab):
    fxdream_ab("bert_base", passes=["fuse_attention"], batch_sizes=(1,))


def test_prepack_linear_inference(fxdream_ab):
    fxdream_ab("bert_base", passes=["prepack_linear"], batch_sizes=(1,))
    fxdream_ab("mnist_convnet", passes=["prepack_linear"], batch_sizes=(8, 32))


def test_the_tutorials_gelu_tanh_pass(fxdream_ab):
    runpy.run_path(str(pathlib.Path(__file__).resolve().parents[1] / "examples" / "gelu_tanh.py"))
    fxdream_ab("bert_base", passes=["gelu_tanh"], batch_sizes=(1,), tiny=True, atol=1e-2)  # tanh GELU: ≤ 1e-3 per op


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["cuda_graphs", "aux_stream_backward"])
def test_gpu_passes(fxdream_ab, name):
    fxdream_ab("resnet18", passes=[name], batch_sizes=(8,), training=name == "aux_stream_backward",
               device="cuda")
