"""The CPU inference engines users pick, as cpu_ab.py runners: ONNX Runtime and OpenVINO.

Each builder takes the eager model and its example inputs and returns a callable taking and
returning torch tensors, so cpu_ab.py checks and times it like any other runner; the build
time includes the export or conversion. Both run with this process's thread count
(``torch.get_num_threads()``) and static shapes (one build per batch):

* ``onnxruntime``: ``torch.onnx.export(dynamo=True)`` to a temporary file, then an
  ``InferenceSession`` on the CPU execution provider (graph optimizations at their default,
  all), its threads not spinning between runs (so the runners timed beside it keep the cores).
* ``openvino_f32``: ``openvino.convert_model`` from the PyTorch model, compiled for the CPU with
  ``INFERENCE_PRECISION_HINT=f32`` and the latency hint.
* ``openvino``: the same with OpenVINO's default precision for this CPU (bf16 where the CPU has
  AVX-512 BF16 or AMX: not fp32 numerics; its max abs diff is in the row).

The packages are optional (``pip install '.[peers]'``); a missing one raises ``PeerUnavailable``
and the runner's row says so.

    python benchmarks/cpu_ab.py --models resnet50 --batches 1,8 \
        --runners eager,fxdream,onnxruntime,openvino_f32,openvino
"""
from __future__ import annotations

import importlib
import os
import tempfile

import numpy as np
import torch

PEERS = ("onnxruntime", "openvino_f32", "openvino")


class PeerUnavailable(RuntimeError):
    """A peer whose package is not installed here."""


def require(name: str):
    """The installed module ``name``, or PeerUnavailable saying how to install it."""
    try:
        return importlib.import_module(name)
    except ImportError as error:
        raise PeerUnavailable(f"{name} is not installed (pip install '.[peers]'): {error}") from None


def _tensors(outputs) -> torch.Tensor | tuple[torch.Tensor, ...]:
    tensors = tuple(torch.from_numpy(np.array(o, copy=True)) for o in outputs)
    return tensors[0] if len(tensors) == 1 else tensors


def build_peer(name: str, model: torch.nn.Module, inputs: tuple):
    """A callable running ``model`` on ``name``'s engine (``PEERS``)."""
    if name == "onnxruntime":
        return _onnxruntime(model, inputs)
    if name in ("openvino_f32", "openvino"):
        return _openvino(model, inputs, f32=name == "openvino_f32")
    raise ValueError(f"unknown peer {name!r}; valid: {', '.join(PEERS)}")


def _onnxruntime(model, inputs):
    ort = require("onnxruntime")
    require("onnxscript")  # torch.onnx.export(dynamo=True) needs it
    path = os.path.join(tempfile.mkdtemp(prefix="fxdream_ort_"), "model.onnx")
    with torch.no_grad():
        torch.onnx.export(model, tuple(inputs), dynamo=True, verbose=False).save(path)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    # ORT's threads spin after each run by default, taking the cores from whatever runs next:
    # interleaved with it, fxdream's ResNet-50 bs1 read 50.9 ms against 44.0 beside OpenVINO alone
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    if len(names) != len(inputs):
        raise RuntimeError(f"the exported graph takes {len(names)} inputs, the model was called with {len(inputs)}")

    def run(*args):
        return _tensors(session.run(None, {n: a.detach().numpy() for n, a in zip(names, args)}))
    return run


def _openvino(model, inputs, f32: bool):
    ov = require("openvino")
    with torch.no_grad():
        converted = ov.convert_model(model, example_input=tuple(inputs))
    config = {"PERFORMANCE_HINT": "LATENCY", "INFERENCE_NUM_THREADS": torch.get_num_threads()}
    if f32:
        config["INFERENCE_PRECISION_HINT"] = "f32"
    compiled = ov.Core().compile_model(converted, "CPU", config)
    request = compiled.create_infer_request()
    outputs = len(compiled.outputs)

    def run(*args):
        request.infer([a.detach().numpy() for a in args])
        return _tensors(request.get_output_tensor(i).data for i in range(outputs))
    precision = compiled.get_property("INFERENCE_PRECISION_HINT")
    run.inference_precision = precision.to_string() if hasattr(precision, "to_string") else str(precision)
    return run
