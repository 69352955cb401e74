"""The pass contract: PassBase derives applies_to from its declaration, choose() applies the one
rule, notes are records, and the runner completes or refuses new nodes without a value."""
import copy
import pickle

import pytest
import torch
import torch.fx as fx

from fxdream.pass_api import LAYER, Note, PassBase, PassContext, PassResult, choose, complete_new_nodes


class CpuInferenceForward(PassBase):
    name = "example"
    devices, modes, phases = ("cpu",), ("inference",), ("fw",)
    why_not = {"device": "no kernel for {device!r}", "mode": "inference only"}

    def requires(self, ctx):
        return "needs a memory budget" if ctx.memory_budget is None else None


def test_applies_to_is_derived_from_the_declaration_in_order_device_mode_phase_then_requires():
    p = CpuInferenceForward()
    assert p.applies_to(PassContext(device="cuda", training=True)) == "no kernel for 'cuda'"
    assert p.applies_to(PassContext(training=True)) == "inference only"
    assert p.applies_to(PassContext(phase="bw")) == "phase 'bw' is not one this pass rewrites (fw)"
    assert p.applies_to(PassContext()) == "needs a memory budget"
    assert p.applies_to(PassContext(memory_budget=1)) is None
    with pytest.raises(NotImplementedError, match="CpuInferenceForward must implement __call__"):
        p(None, PassContext())


def test_choose_forced_applies_the_fastest_and_auto_declines_unless_faster():
    times = {"a": 12.0, "b": 11.0}
    auto, named = PassContext(forced=False), PassContext(forced=True)
    assert choose(auto, 10.0, times).chosen is None
    forced = choose(named, 10.0, times)
    assert (forced.chosen, forced.forced, forced.speedup) == ("b", True, pytest.approx(10.0 / 11.0))
    faster = choose(auto, 12.0, times)
    assert (faster.chosen, faster.forced, faster.baseline_us) == ("b", False, 12.0)
    assert choose(named, 10.0, {}).chosen is None
    with pytest.raises(ValueError, match="choose\\(\\) needs ctx.predict_us"):
        choose(named, 10.0, {"g": fx.GraphModule(torch.nn.Module(), fx.Graph())})


def test_a_note_reads_as_its_text_and_keeps_its_fields():
    note = Note("layer1.conv", "grouped", "skipped")
    assert note == "layer1.conv: skipped: grouped" and (note.subject, note.kind, note.detail) == (
        "layer1.conv", "skipped", "grouped")
    assert Note("", "predicted: 1 ms") == "predicted: 1 ms"
    assert pickle.loads(pickle.dumps(note)).kind == "skipped"
    with pytest.raises(AttributeError, match="immutable"):
        note.kind = "other"
    result = PassResult.changed(None, "did it", [note])
    assert result.modified and result.notes == (note,) and not PassResult.unchanged(None, "no").modified


def test_new_nodes_get_a_layer_and_a_value_or_are_named():
    from torch._subclasses.fake_tensor import FakeTensorMode
    graph = fx.Graph()
    x = graph.placeholder("x")
    relu = graph.call_function(torch.ops.aten.relu.default, (x,))
    graph.output(relu)
    with FakeTensorMode():
        x.meta["val"] = torch.empty(2, 3)
        relu.meta.update({"val": torch.empty(2, 3), LAYER: "act"})
    before = fx.GraphModule(torch.nn.Module(), copy.deepcopy(graph))
    with graph.inserting_after(relu):
        added = graph.call_function(torch.ops.aten.neg.default, (relu,))
        opaque = graph.call_function(print, ())
    missing = complete_new_nodes(before, fx.GraphModule(torch.nn.Module(), graph))
    assert missing == [f"{opaque.name} (print) has no meta['val']"]  # no input with a fake tensor
    assert added.meta[LAYER] == "act" and tuple(added.meta["val"].shape) == (2, 3)
    assert opaque.meta[LAYER] == ""
