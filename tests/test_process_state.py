"""A build leaves the process as it found it: the user's own torch.compile of the same class
compiles the graphs it compiles in a fresh process, and the user's compilations before a build
do not change what the build captures."""
import torch
import torch.nn as nn

import fxdream


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1)
        self.bn = nn.BatchNorm2d(width)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x))).mean((2, 3))


def _compiled_graphs(model, x) -> list[str]:
    """The code of every graph ``torch.compile(model)`` hands its backend for one call."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return gm.forward
    with torch.no_grad():
        torch.compile(model, backend=backend)(x)
    return graphs


def _symbolic(gm) -> bool:
    return any(isinstance(s, torch.SymInt) for n in gm.graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)
               for s in n.meta["val"].shape)


def test_torch_compile_after_builds_of_the_class_compiles_what_a_fresh_process_does():
    model, x = Block(8).eval(), torch.randn(2, 3, 16, 16)
    torch._dynamo.reset()
    fresh = _compiled_graphs(model, x)
    torch._dynamo.reset()
    for width, size in ((4, 8), (6, 12)):  # other sizes of the same class, through dynamo (training)
        fxdream.optimize(Block(width).train(), (torch.randn(2, 3, size, size),), training=True, cost=None)
    after = _compiled_graphs(model, x)
    assert after == fresh
    assert "sym_size" not in "".join(after)  # static shapes, as in the fresh process


def test_a_build_after_the_users_dynamic_compilations_captures_static_graphs():
    torch._dynamo.reset()
    fresh = fxdream.capture(Block(8).train(), (torch.randn(2, 3, 16, 16),), training=True)
    torch._dynamo.reset()
    for size in (8, 12):  # the user's compilations of two sizes: dynamo marks the sizes dynamic
        _compiled_graphs(Block(8).eval(), torch.randn(2, 3, size, size))
    after = fxdream.capture(Block(8).train(), (torch.randn(2, 3, 16, 16),), training=True)
    assert not _symbolic(after.forward) and not _symbolic(after.backward)
    assert after.forward.code == fresh.forward.code and after.backward.code == fresh.backward.code


def test_a_build_leaves_grad_mode_rng_threads_and_dynamos_limits_as_they_were():
    config = torch._dynamo.config
    name = "recompile_limit" if hasattr(config, "recompile_limit") else "cache_size_limit"
    limit, threads, grad = getattr(config, name), torch.get_num_threads(), torch.is_grad_enabled()
    models, x = (Block(4).train(), Block(4).eval()), torch.randn(2, 3, 8, 8)
    torch.manual_seed(123)
    rng = torch.get_rng_state()
    fxdream.optimize(models[0], (x,), training=True, cost=None)
    fxdream.optimize(models[1], (x,), cost=None)
    assert getattr(config, name) == limit and torch.get_num_threads() == threads
    assert torch.is_grad_enabled() == grad and torch.equal(torch.get_rng_state(), rng)


def test_a_torch_compiled_model_whose_cache_is_full_is_captured_as_the_model_itself():
    """torch.compile's wrapper is looked through (the model itself is traced): past dynamo's
    recompile limit, with its caches filled by earlier builds of the class, a build through the
    wrapper captured no graph ("OptimizedModule.__call__ ... marked as skipped")."""
    class Small(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x):
            return self.b(torch.relu(self.a(x)) + x)

    model = Small().eval()
    compiled = torch.compile(model, backend="eager", dynamic=False)
    with torch.no_grad():
        for batch in range(1, 11):  # past the recompile limit (8)
            compiled(torch.randn(batch, 8))
    x = torch.randn(3, 8)
    for training in (False, True):
        built = fxdream.optimize(compiled, (x,), training=training)
        assert built.report.fallback_reason is None and built.report.graphs
        assert built.report.capture == ("dynamo (training)" if training else "torch.fx symbolic_trace")
        torch.testing.assert_close(built(x), model(x))
