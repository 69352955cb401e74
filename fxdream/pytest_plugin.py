"""pytest plugin (entry point ``pytest11``): a per-pass A/B benchmark test in a few lines.

    import pytest

    @pytest.mark.ab
    def test_my_pass_ab(fxdream_ab):
        fxdream_ab("resnet18", passes=["my_pass"], batch_sizes=(1, 8))

``fxdream_ab`` runs ``fxdream.ab``: eager, the capture without the passes and with them, timed
interleaved in this process, with the predictions beside. It fails the test when the
optimized module's outputs (and in training every gradient) differ from eager's by more than
``atol``; never on timings, which belong to the machine of the moment. The tables are printed
in the terminal summary; ``--fxdream-ab-json=PATH`` writes every result of the session to one file.

Tests marked ``ab`` that use the fixture time real models, so they are skipped unless selected
by marker (``pytest -m ab``): a plain ``pytest`` run stays a correctness run.
"""
from __future__ import annotations

import json
import os
import re

import pytest

from fxdream.ab import ab

AB_ONLY = "an A/B timing test: run it with `pytest -m ab`"
_RESULTS = pytest.StashKey[list]()


def pytest_addoption(parser):
    parser.getgroup("fxdream").addoption(
        "--fxdream-ab-json", metavar="PATH", default=None,
        help="write the results of every fxdream_ab call of the session to PATH (JSON)")


def pytest_configure(config):
    config.addinivalue_line("markers", "ab: an fxdream A/B timing test (skipped unless selected with -m ab)")
    config.stash[_RESULTS] = []
    path = config.getoption("fxdream_ab_json")
    folder = os.path.dirname(path) if path else ""
    if folder and not os.path.isdir(folder):  # found only at the end, it would cost the whole run
        raise pytest.UsageError(f"--fxdream-ab-json {path}: no folder {folder!r}")


def pytest_collection_modifyitems(config, items):
    if re.search(r"\bab\b", config.getoption("markexpr", "") or ""):
        return  # the run selects by the marker: it asked for the A/B tests (or excluded them)
    for item in items:  # only fxdream's A/B tests: another plugin's ``ab`` marker is left alone
        if item.get_closest_marker("ab") is not None and "fxdream_ab" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.skip(reason=AB_ONLY))


@pytest.fixture
def fxdream_ab(request):
    """``fxdream_ab(model, passes, batch_sizes=(1,), training=False, device="cpu", tiny=False,
    rounds=5, block=10, atol=1e-3)`` → ``fxdream.ab.ABResult``, after asserting numerics.

    ``model`` is a zoo name or ``build(batch_size) -> (model, example_inputs, loss_fn)``;
    ``passes`` are names or Pass objects (register a pass before naming it)."""

    def run(model, passes, batch_sizes=(1,), training: bool = False, device: str = "cpu",
            tiny: bool = False, rounds: int = 5, block: int = 10, atol: float = 1e-3):
        result = ab(model, passes, batch_sizes=tuple(batch_sizes), training=training, device=device,
                    tiny=tiny, rounds=rounds, block=block, progress=False)
        request.config.stash[_RESULTS].append((request.node.nodeid, result))
        request.node.user_properties.append(("fxdream_ab", result.to_json()))
        for row in result.rows:
            if not row.max_abs_diff <= atol:  # NaN fails too
                pytest.fail(f"{row.model} bs{row.batch} ({'training' if row.training else 'inference'}): "
                            f"{'+'.join(row.passes)} changed the results: max abs diff {row.max_abs_diff:.3e} "
                            f"vs eager > atol {atol:g} ({'; '.join(row.pass_reasons)})", pytrace=False)
        return result
    return run


def pytest_terminal_summary(terminalreporter, config):
    results = config.stash.get(_RESULTS, [])
    if not results:
        return
    terminalreporter.section("fxdream A/B (measured; predicted columns are predictions)")
    for nodeid, result in results:
        terminalreporter.write_line(nodeid)
        terminalreporter.write_line(result.to_markdown())
        terminalreporter.write_line("")
    path = config.getoption("fxdream_ab_json")
    if path:
        with open(path, "w") as f:
            json.dump([dict(json.loads(r.to_json()), test=nodeid) for nodeid, r in results], f, indent=1)
        terminalreporter.write_line(f"fxdream A/B results: {path}")
