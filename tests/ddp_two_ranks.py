"""Worker for tests/test_ddp_wrapping.py: each of two gloo ranks trains one step of
DistributedDataParallel(fxdream.optimize(net)) and of DistributedDataParallel(net) on its own
batch, and writes both all-reduced gradients to a file."""
import os
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def net():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def run(rank: int, init: str, out: str) -> None:
    import fxdream
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        torch.manual_seed(100 + rank)
        x = torch.randn(4, 8)  # each rank its own batch: the all-reduce averages them
        grads = {}
        for name, optimized in (("eager", False), ("fxdream", True)):
            model = net()
            inner = fxdream.optimize(model, (x,), training=True, cost=None) if optimized else model
            wrapped = nn.parallel.DistributedDataParallel(inner)
            wrapped(x).sum().backward()
            grads[name] = [p.grad.clone() for p in model.parameters()]
        torch.save(grads, f"{out}.{rank}")
    except BaseException:
        dist.destroy_process_group()
        raise
    # The results are written: exit now, before the DDP modules and the process group are freed.
    # Freeing them can block a gloo rank's process for good (plain DistributedDataParallel
    # without fxdream as well), and the test would wait out its timeout.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    run(int(sys.argv[1]), sys.argv[2], sys.argv[3])
