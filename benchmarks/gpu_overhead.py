"""Per-call overhead of CUDA-graph runners on a tiny graph (3 one-element ops), for gpu_ab.

The kernels take a few µs; the rest is host: eager, fxdream's CudaGraphRunner alone and inside
an ``optimize``d module, torch.compile(mode="reduce-overhead"), and a bare
``CUDAGraph.replay()`` as the floor.
"""
from __future__ import annotations

import statistics
import time

import torch

import fxdream
from fxdream.runtime.cuda_graph_runner import CudaGraphRunner, describe_runners


class _Tiny(torch.nn.Module):
    def forward(self, x):
        return ((x + 1) * 2).relu()


def _per_call_us(fn, x, calls: int, rounds: int) -> float:
    for _ in range(10):
        fn(x)
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            fn(x)
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(samples)


def runner_overhead(log=print, calls: int = 2000, rounds: int = 5) -> dict:
    """µs per call of a 3-op graph on a 1-element tensor: the kernels take a few µs, the rest is host."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from fxdream.passes.cuda_graphs import CudaGraphs
    x = torch.zeros(1, device="cuda")
    tiny = _Tiny().cuda()
    results, builds = {}, {}
    with torch.no_grad():
        gm = make_fx(tiny)(x)
        runner = CudaGraphRunner(gm, 0, (False,))
        fns = {"eager": tiny, "fxdream_runner": lambda t: runner(t)}
        started = time.perf_counter()
        fns["fxdream_optimize"] = fxdream.optimize(tiny, (x,), cost="analytic",
                                                   passes=[CudaGraphs(min_gain_us=float("-inf"))])
        builds["fxdream_optimize"] = time.perf_counter() - started
        started = time.perf_counter()
        compiled = torch.compile(_Tiny().cuda(), mode="reduce-overhead")
        for _ in range(3):
            compiled(x)
        builds["reduce_overhead"] = time.perf_counter() - started
        fns["reduce_overhead"] = compiled
        static_x = x.clone()
        graph = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            tiny(static_x)
        torch.cuda.current_stream().wait_stream(side)
        with torch.cuda.graph(graph):
            tiny(static_x)

        def bare(t):
            static_x.copy_(t)
            graph.replay()
        fns["bare_cudagraph_replay"] = bare
        for name, fn in fns.items():
            results[name] = _per_call_us(fn, x, calls, rounds)
            log(f"  tiny graph: {name:<22} {results[name]:7.2f} µs per call")
    floor = results["bare_cudagraph_replay"]
    return dict(us_per_call=results, overhead_us_over_bare_replay={k: v - floor for k, v in results.items()},
                build_s=builds, runners=list(describe_runners(fns["fxdream_optimize"])),
                fxdream_vs_reduce_overhead=results["fxdream_optimize"] / results["reduce_overhead"],
                runner_vs_reduce_overhead=results["fxdream_runner"] / results["reduce_overhead"])
