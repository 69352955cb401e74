"""The host allocator's fresh pages: counted per measured call, reported, and kept on request."""
import os
import platform
import subprocess
import sys
import textwrap

import pytest
import torch

import fxdream
from fxdream.measure import time_interleaved
from fxdream.runtime import host_memory
from fxdream.sim.cost.run_spread import RunSpread

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
DEFAULT_MALLOC = GLIBC and not any(name.startswith("MALLOC_") for name in os.environ)
needs_default_glibc = pytest.mark.skipif(not DEFAULT_MALLOC, reason="counts glibc's default malloc's page faults")
# above glibc's largest dynamic mmap threshold (32 MiB): its default malloc maps such a buffer
# afresh on every allocation, and every 4 KiB page written faults once
FRESH_FLOATS = 40 * 2**20 // 4
FRESH_PAGES = 40 * 2**20 // host_memory.page_bytes()


class FreshBuffer(torch.nn.Module):
    def forward(self, x):
        return x.expand(FRESH_FLOATS).exp().sum()


@needs_default_glibc
def test_a_measurement_counts_the_fresh_pages_of_each_call():
    result = time_interleaved({"fresh": lambda: torch.ones(FRESH_FLOATS).sum()}, rounds=2, block=2, warmup=1,
                              progress=False)
    assert result["fresh"].page_faults_per_call >= 0.9 * FRESH_PAGES


@needs_default_glibc
def test_measure_reports_the_optimized_calls_page_faults_and_the_switch():
    optimized = fxdream.optimize(FreshBuffer(), (torch.ones(1),), measure=True, cost=None)
    report = optimized.report
    assert report.measured_page_faults_per_call >= 0.9 * FRESH_PAGES
    note = next(n for n in report.notes if "page-faulted" in n)
    assert "MiB of fresh pages" in note and "fxdream.keep_freed_memory()" in note


@needs_default_glibc
def test_a_build_says_how_much_fresh_memory_the_runs_it_timed_faulted_on():
    optimized = fxdream.optimize(FreshBuffer(), (torch.ones(1),), passes="auto", eager_check=False)
    note = next(n for n in optimized.report.notes if n.startswith("while the build timed them"))
    baseline = int(note.split("the capture without passes page-faulted ")[1].split(" times")[0].replace(",", ""))
    assert baseline >= 0.9 * FRESH_PAGES
    assert "the optimized graphs page-faulted" in note and "fxdream.keep_freed_memory()" in note


def test_a_run_spread_keeps_the_page_faults_of_its_median_run():
    spread = RunSpread.of_runs(frozenset({"k"}), [10.0, 12.0, 11.0], [5, 100, 7])
    assert spread.page_faults_per_run == 7
    assert RunSpread.of_runs(frozenset({"k"}), [10.0, 12.0]).page_faults_per_run is None


def test_timed_faults_are_noted_only_where_a_side_took_many():
    few = host_memory.FAULTS_WORTH_A_NOTE - 1
    assert host_memory.timed_fresh_memory_note(few, few) is None
    assert host_memory.timed_fresh_memory_note(None, None) is None
    note = host_memory.timed_fresh_memory_note(None, 2048.0)
    assert "the optimized graphs page-faulted 2,048 times a run (8 MiB of fresh memory)" in note
    assert "capture without passes" not in note


def test_few_faults_need_no_note():
    assert host_memory.fresh_memory_note(host_memory.FAULTS_WORTH_A_NOTE - 1) is None
    assert host_memory.fresh_memory_note(None) is None
    assert "page-faulted 2,048 times (8 MiB" in host_memory.fresh_memory_note(2048.0)


@needs_default_glibc
def test_keeping_freed_memory_ends_the_faults_of_a_buffer_allocated_again():
    # in a process of its own: the switch holds for the rest of the process
    script = textwrap.dedent(f"""
        import torch
        from fxdream.runtime.host_memory import keep_freed_memory, page_faults

        def faults_of_one_allocation():
            before = page_faults()
            torch.ones({FRESH_FLOATS}).sum()
            return page_faults() - before

        faults_of_one_allocation()
        default = faults_of_one_allocation()
        kept = keep_freed_memory()
        faults_of_one_allocation()  # the heap grows to hold it once
        print(default, faults_of_one_allocation(), kept.mmap_threshold_bytes)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, check=True)
    default, kept, threshold = map(int, out.stdout.split())
    assert default >= 0.9 * FRESH_PAGES
    assert kept < 0.05 * FRESH_PAGES
    assert threshold == 2**31 - 1


def test_keep_freed_memory_names_what_it_needs_elsewhere(monkeypatch):
    monkeypatch.setattr(host_memory, "_glibc", lambda: None)
    with pytest.raises(RuntimeError, match="needs glibc's malloc"):
        fxdream.keep_freed_memory()


@pytest.mark.parametrize("glibc", [True, False])
def test_settling_allocates_and_frees_one_buffer_just_under_glibcs_ceiling_where_glibc_runs(monkeypatch, glibc):
    """glibc raises its mmap threshold to the size of a mapped buffer freed, up to its ceiling
    (32 MiB), and its trim threshold to twice that: one unwritten buffer just under the ceiling
    puts both there (their effect on a first build: docs/measurements.md, 2026-11-29)."""
    allocated = []
    monkeypatch.setattr(host_memory, "_glibc", lambda: object() if glibc else None)
    monkeypatch.setattr(host_memory.torch, "empty", lambda *shape, dtype: allocated.append((shape, dtype)))
    host_memory.settle_dynamic_thresholds.__wrapped__()
    if glibc:
        (((size,), dtype),) = allocated
        assert dtype == torch.uint8 and 31 * 2**20 < size < host_memory.DYNAMIC_MMAP_THRESHOLD_MAX == 32 * 2**20
    else:
        assert allocated == []
