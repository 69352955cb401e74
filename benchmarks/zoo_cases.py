"""What the zoo benchmarks that run case by case share: the dtypes they take by name, the name
of the device they ran on, and a loop over (model, batch, mode) cases that goes on past a case
that fails and writes the results after every row, so that a run cut short by a time limit (a
GPU lease's) keeps what it measured."""
from __future__ import annotations

import itertools
import json
import sys
from typing import Callable

import torch

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def device_name(device: str) -> str:
    """The GPU's name, or "cpu, N threads"."""
    if torch.device(device).type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu, {torch.get_num_threads()} threads"


def run_cases(models: str, batches: str, modes: str, measure: Callable[[str, int, bool], dict], out: str,
              header: dict, to_markdown: Callable[[list[dict]], str],
              after_row: Callable[[dict], None] | None = None) -> list[dict]:
    """``measure(model, batch, training)`` for each case of the comma-separated lists; a case
    that raises is skipped with its reason (one case's failure, memory or an op, costs that
    case only). After each row ``after_row(row)``, then ``out.json`` (``header``, the rows, the
    skipped cases) and ``out.md`` are written. Returns the rows."""
    rows, skipped = [], []
    for name, batch, mode in itertools.product(models.split(","), map(int, batches.split(",")), modes.split(",")):
        try:
            row = measure(name, batch, mode == "train")
        except Exception as error:
            skipped.append(f"{name} bs{batch} {mode}: {type(error).__name__}: {str(error)[:300]}")
            print(skipped[-1], file=sys.stderr, flush=True)
            continue
        rows.append(row)
        if after_row is not None:
            after_row(row)
        with open(out + ".json", "w") as f:
            json.dump({**header, "rows": rows, "skipped": skipped}, f, indent=1)
        with open(out + ".md", "w") as f:
            f.write(to_markdown(rows))
    return rows
