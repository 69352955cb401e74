"""Run each benchmark case in its own process, so one crash or hang costs one case.

A CUDA error such as "an illegal memory access" leaves the process's CUDA context unusable:
on an H200 one case (transformers' BERT, fxdream's CUDA graph beside reduce-overhead's) ended
a gpu_ab run there, and the cases after it were never measured, in a lease of 15 minutes.
``run_isolated`` starts ``python SCRIPT ARGS --case CASE --case-out FILE`` per case, with a time
limit, and reads the case's JSON back; a child that fails, hangs or writes nothing becomes a
skipped case with the reason and the tail of its output.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterable


def child_command(script: str, args: list[str], case: str, out: str) -> list[str]:
    return [sys.executable, script, *args, "--case", case, "--case-out", out]


def run_isolated(cases: Iterable[str], script: str, args: list[str], timeout_s: float,
                 budget_s: float = float("inf"), log: Callable[[str], None] = print
                 ) -> Iterable[tuple[str, dict | None, str | None]]:
    """Yield (case, result, None) or (case, None, why it has no result) per case, in order; the
    child's output is logged as it comes. No case starts once ``budget_s`` is spent."""
    started = time.perf_counter()
    for case in cases:
        elapsed = time.perf_counter() - started
        if elapsed > budget_s:
            yield case, None, f"time budget spent ({elapsed:.0f} s > {budget_s:.0f} s)"
            continue
        with tempfile.TemporaryDirectory() as folder:
            out = str(Path(folder) / "case.json")
            returncode, output = _run_logged(child_command(script, args, case, out), timeout_s, log)
            if returncode is None:
                yield case, None, f"no result within {timeout_s:.0f} s{_tail(output)}"
            elif returncode != 0:
                yield case, None, f"the case's process exited with {returncode}{_tail(output)}"
            else:
                try:
                    yield case, json.loads(Path(out).read_text()), None
                except (OSError, ValueError) as error:
                    yield case, None, f"the case wrote no result ({type(error).__name__}: {error}){_tail(output)}"


def _run_logged(command: list[str], timeout_s: float, log) -> tuple[int | None, str]:
    """(exit code, or None if killed at ``timeout_s``; its output), logging each line as it comes."""
    lines: list[str] = []
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def pump():
        for line in process.stdout:
            lines.append(line.rstrip("\n"))
            log(f"  | {lines[-1]}")
    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        returncode = process.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        returncode = None
    reader.join(timeout=5)
    return returncode, "\n".join(lines)


def _tail(output: str, lines: int = 6) -> str:
    kept = [line for line in (output or "").splitlines() if line.strip()][-lines:]
    return (": " + " / ".join(kept)) if kept else ""
