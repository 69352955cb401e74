"""Ops an inference capture keeps whole, each alone in a module: eager, captured, decomposed.

The ops of upsample_op, pad_op, max_pool1d_op and rnn_cell_op: eager against the capture
(medians of interleaved blocks, same process), and with ``--decomposed`` the capture with the
op left to torch's decomposition, as it was before.

    python benchmarks/whole_ops.py [--decomposed] [--json benchmarks/results/whole_ops_cpu_<date>.json]
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import fxdream  # noqa: E402
from fxdream.measure import time_interleaved  # noqa: E402
from fxdream.ops import keep_whole  # noqa: E402


def cases() -> dict:
    image, volume, signal = torch.randn(1, 64, 64, 64), torch.randn(1, 16, 8, 32, 32), torch.randn(8, 64, 512)
    torch.manual_seed(0)
    steps = torch.randn(16, 256)
    return {
        "bilinear 2x": (lambda x: F.interpolate(x, scale_factor=2, mode="bilinear"), image),
        "nearest 2x": (lambda x: F.interpolate(x, scale_factor=2, mode="nearest"), image),
        "bicubic to 50x70": (lambda x: F.interpolate(x, size=(50, 70), mode="bicubic"), image),
        "trilinear 2x": (lambda x: F.interpolate(x, scale_factor=2, mode="trilinear"), volume),
        "circular pad 2": (lambda x: F.pad(x, (2, 2, 2, 2), mode="circular"), image),
        "3x3 conv, circular padding": (nn.Conv2d(64, 64, 3, padding=1, padding_mode="circular"), image),
        "max_pool1d 3/2": (lambda x: F.max_pool1d(x, 3, 2), signal),
        "GRUCell 256": (nn.GRUCell(256, 256), steps),
        "LSTMCell 256": (nn.LSTMCell(256, 256), steps),
    }


class _Call(nn.Module):
    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, x):
        return self.function(x)


@contextlib.contextmanager
def _decomposed():
    """The capture as before the ops were kept whole: no redirections."""
    saved = dict(keep_whole._REDIRECTS)
    keep_whole._REDIRECTS.clear()
    original = keep_whole.upsample_calls_redirected
    keep_whole.upsample_calls_redirected = contextlib.nullcontext
    try:
        yield
    finally:
        keep_whole._REDIRECTS.update(saved)
        keep_whole.upsample_calls_redirected = original


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--decomposed", action="store_true", help="also time the capture without the whole ops")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    with torch.no_grad():
        rows = _rows(args)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(date=str(datetime.date.today()), torch=torch.__version__,
                                                   threads=torch.get_num_threads(), rows=rows), indent=1))


def _rows(args) -> list[dict]:
    rows = []
    print("| op | input | eager ms | captured ms | ratio |" + (" decomposed ms | ratio |" if args.decomposed else ""))
    print("|---|---|---|---|---|" + ("---|---|" if args.decomposed else ""))
    for name, (function, x) in cases().items():
        model = _Call(function).eval()
        runners = {"eager": lambda: model(x)}
        whole = fxdream.optimize(model, (x,), cost=None)
        runners["captured"] = lambda: whole(x)
        if args.decomposed:
            with _decomposed():
                decomposed = fxdream.optimize(model, (x,), cost=None)
            runners["decomposed"] = lambda: decomposed(x)
        measured = time_interleaved(runners, rounds=args.rounds, block=5, progress=False)
        times = {k: m.median_ms for k, m in measured.items()}
        row = dict(op=name, input=list(x.shape), **{f"{k}_ms": v for k, v in times.items()})
        rows.append(row)
        line = f"| {name} | {'x'.join(map(str, x.shape))} | {times['eager']:.3f} | {times['captured']:.3f} | " \
               f"{times['captured'] / times['eager']:.2f}x |"
        if args.decomposed:
            line += f" {times['decomposed']:.3f} | {times['decomposed'] / times['eager']:.2f}x |"
        print(line, flush=True)
    return rows


if __name__ == "__main__":
    main()
