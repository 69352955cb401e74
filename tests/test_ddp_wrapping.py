"""DistributedDataParallel and optimize: DDP around the optimized module keeps DDP's gradient
hooks and equals eager; optimize(DDP(model)) runs the model as it is and says how to wrap it.
One gloo process (world size 1): the hooks and the all-reduce run as with more."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fxdream

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")


@pytest.fixture
def gloo_group():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _grads(module, net, x):
    for p in net.parameters():
        p.grad = None
    module(x).sum().backward()
    return [p.grad.clone() for p in net.parameters()]


def test_ddp_around_the_optimized_module_reduces_gradients_equal_to_eager(gloo_group):
    x = torch.randn(4, 8)
    eager_net, net = _net(), _net()
    expected = _grads(nn.parallel.DistributedDataParallel(eager_net), eager_net, x)
    wrapped = nn.parallel.DistributedDataParallel(fxdream.optimize(net, (x,), training=True, cost=None))
    for got, want in zip(_grads(wrapped, net, x), expected):
        torch.testing.assert_close(got, want)


def test_optimizing_a_ddp_model_runs_it_as_it_is_and_says_to_wrap_ddp_outside(gloo_group):
    net, x = _net(), torch.randn(4, 8)
    ddp = nn.parallel.DistributedDataParallel(net)
    optimized = fxdream.optimize(ddp, (x,), training=True, cost=None)
    assert "DistributedDataParallel(fxdream.optimize(model, ...))" in optimized.report.fallback_reason
    torch.testing.assert_close(_grads(optimized, net, x), _grads(ddp, net, x))
    with pytest.raises(fxdream.CaptureError, match="strict=True: the model is a DistributedDataParallel"):
        fxdream.optimize(ddp, (x,), training=True, cost=None, strict=True)


def test_two_gloo_ranks_reduce_the_optimized_modules_gradients_as_eager(tmp_path):
    import subprocess
    import sys
    from pathlib import Path
    worker = Path(__file__).with_name("ddp_two_ranks.py")
    out, store = str(tmp_path / "grads"), f"file://{tmp_path / 'store'}"  # a file store: no port to race for
    ranks = [subprocess.Popen([sys.executable, str(worker), str(rank), store, out], stderr=subprocess.PIPE,
                              text=True) for rank in (0, 1)]
    try:
        errors = [p.communicate(timeout=180)[1] for p in ranks]
    except subprocess.TimeoutExpired:
        pytest.skip("two gloo processes did not finish in 180 s here")
    finally:
        for p in ranks:
            p.kill()
    assert [p.returncode for p in ranks] == [0, 0], errors
    for rank in (0, 1):
        grads = torch.load(f"{out}.{rank}")
        for got, want in zip(grads["fxdream"], grads["eager"]):
            torch.testing.assert_close(got, want)
    first, second = (torch.load(f"{out}.{rank}")["fxdream"] for rank in (0, 1))
    assert all(torch.equal(a, b) for a, b in zip(first, second))  # all-reduced: the same on both ranks
