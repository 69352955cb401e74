"""The pytest plugin (entry point pytest11): an A/B test in a few lines, skipped unless selected
with ``-m ab``, failing on changed numerics and never on timings."""
import json

pytest_plugins = ["pytester"]

AB_TESTS = '''
import pytest
import torch
import fxdream
from fxdream.ir.nodes import op_name
from fxdream.pass_api import PassResult


class Nudge:  # a broken "optimization": scales every ReLU's output
    name = "nudge_relu"

    def applies_to(self, ctx):
        return None if ctx.phase == "fw" else "forward only"

    def __call__(self, gm, ctx):
        for node in list(gm.graph.nodes):
            if op_name(node) == "aten.relu":
                with gm.graph.inserting_after(node):
                    scaled = gm.graph.call_function(torch.ops.aten.mul.Tensor, (node, 1.5))
                node.replace_all_uses_with(scaled, delete_user_cb=lambda user: user is not scaled)
        gm.recompile()
        return PassResult(gm, True, "scaled")


@pytest.mark.ab
def test_fusion(fxdream_ab):
    result = fxdream_ab("mnist_convnet", passes=["fuse_conv_bias_act"], batch_sizes=(2,), tiny=True,
                        rounds=1, block=1)
    assert result.rows[0].optimized.median_ms > 0


@pytest.mark.ab
def test_broken_pass(fxdream_ab):
    fxdream_ab("mnist_convnet", passes=[Nudge()], batch_sizes=(2,), tiny=True, rounds=1, block=1)


def test_plain():
    pass


@pytest.mark.ab
def test_another_plugins_ab_marker():  # not an fxdream A/B test: runs in a plain run
    pass
'''


def test_ab_tests_are_skipped_in_a_plain_run(pytester):
    pytester.makepyfile(AB_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-rs")
    result.assert_outcomes(passed=2, skipped=2)
    assert "an A/B timing test: run it with `pytest -m ab`" in result.stdout.str()


def test_selected_ab_tests_run_and_a_pass_that_changes_results_fails(pytester):
    pytester.makepyfile(AB_TESTS)
    out = pytester.path / "ab.json"
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "ab", f"--fxdream-ab-json={out}")
    result.assert_outcomes(passed=2, failed=1)
    text = result.stdout.str()
    assert "nudge_relu changed the results: max abs diff" in text and "> atol 0.001" in text
    assert "fxdream A/B (measured; predicted columns are predictions)" in text
    assert "| mnist_convnet | 2 | infer | fuse_conv_bias_act |" in text
    saved = json.loads(out.read_text())
    assert [entry["test"].split("::")[1] for entry in saved] == ["test_fusion", "test_broken_pass"]
    assert saved[0]["rows"][0]["max_abs_diff"] <= 1e-3 < saved[1]["rows"][0]["max_abs_diff"]


def test_a_json_path_without_its_folder_stops_the_run_before_it_starts(pytester):
    pytester.makepyfile(AB_TESTS)
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider", "-m", "ab", "--fxdream-ab-json=/nonexistent/x.json")
    assert result.ret == 4  # pytest's usage error
    assert "--fxdream-ab-json /nonexistent/x.json: no folder '/nonexistent'" in result.stderr.str()
    assert "passed" not in result.stdout.str()  # nothing ran
