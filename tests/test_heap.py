"""The build freezes the objects from before it for the garbage collector, and only then."""
import gc

import torch

import fxdream
from fxdream.capturing.gc_freeze import older_objects_frozen


def test_objects_are_frozen_in_the_body_and_unfrozen_after():
    assert gc.get_freeze_count() == 0
    with older_objects_frozen():
        assert gc.get_freeze_count() > 0
        made_inside = [[]]
        assert gc.is_tracked(made_inside)
    assert gc.get_freeze_count() == 0


def test_an_outer_freeze_is_left_as_it_is():
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        with older_objects_frozen():
            with older_objects_frozen():
                pass
            assert 0 < gc.get_freeze_count() <= frozen  # neither undone nor frozen again (frozen
        assert 0 < gc.get_freeze_count() <= frozen  # objects that die leave the count: it may drop)
    finally:
        gc.unfreeze()


def test_nothing_is_frozen_while_the_collector_is_off():
    gc.disable()
    try:
        with older_objects_frozen():
            assert gc.get_freeze_count() == 0
    finally:
        gc.enable()


def test_optimize_freezes_while_it_builds_and_leaves_nothing_frozen(monkeypatch):
    seen = []
    build = fxdream.build._build
    monkeypatch.setattr(fxdream.build, "_build", lambda *a: seen.append(gc.get_freeze_count()) or build(*a))
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()).eval()
    x = torch.randn(2, 4)
    out = fxdream.optimize(model, (x,), cost=None)(x)
    assert seen and seen[0] > 0 and gc.get_freeze_count() == 0
    torch.testing.assert_close(out, model(x))
