"""The eager check: a built module timed against the model it was built from, and sent to run
eagerly where it is measured slower (short calls only: there the wrappers around the graphs can
cost more than the passes save)."""
from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

from fxdream.capturing.model_state import preserved_state
from fxdream.capturing.steps import seeded_step
from fxdream.measure import time_interleaved
from fxdream.optimized_module import OptimizedModule
from fxdream.report import MEASURED_SLOWER
from fxdream.sim.cost import Profiled

EAGER_CHECK_MAX_CALL_MS = 20.0
EAGER_CHECK_TOLERANCE = 1.05


def check_against_eager(model, module: OptimizedModule, inputs, training: bool, restore: Callable[[], None],
                        predicted_ms: float | None = None) -> dict:
    """Time the module against eager (short calls only); run eagerly where eager is faster. Each
    call, and the check's end, run ``restore`` first (the example's Python objects put back: a
    cache object the calls append to).

    Not even one eager call where the captured graphs' ops, timed in context, predict a call of
    more than twice the limit (``predicted_ms``): a large model's eager calls would cost the
    build more than the check can tell."""
    measured_costs = isinstance(module._cost_model, Profiled)
    if measured_costs and predicted_ms is not None and predicted_ms > 2 * EAGER_CHECK_MAX_CALL_MS:
        module._note(
            f"not timed against eager: the captured graphs' ops alone take {predicted_ms:.1f} ms (predicted from "
            f"their times measured here), and the check times calls of ≤ {EAGER_CHECK_MAX_CALL_MS:g} ms")
        return {}
    eager = seeded_step(model, inputs, training, before_each=restore)
    with preserved_state(model), torch.set_grad_enabled(training), contextlib.ExitStack() as after:
        after.callback(restore)
        call_ms = []
        for _ in range(2):  # the faster of two: a first call can be cold, but not 5x the limit
            started = time.perf_counter()
            eager()
            call_ms.append((time.perf_counter() - started) * 1e3)
            if call_ms[0] > 5 * EAGER_CHECK_MAX_CALL_MS:  # far over the limit: a second call tells nothing
                break
        one_call_ms = min(call_ms)
        if one_call_ms > EAGER_CHECK_MAX_CALL_MS:
            module._note(
                f"not timed against eager: an eager call takes {one_call_ms:.1f} ms, and the check times calls of "
                f"≤ {EAGER_CHECK_MAX_CALL_MS:g} ms (where the graphs' Python overhead can outweigh the passes)")
            return {}
        block = max(1, min(20, int(10.0 / max(one_call_ms, 1e-3))))  # ~10 ms per block
        built = seeded_step(module.called_positionally(), inputs, training, before_each=restore)
        times = time_interleaved({"eager": eager, "built": built},
                                 rounds=7, block=block, warmup=2, progress=False)  # ~0.2 s
    eager_ms, built_ms = times["eager"].median_ms, times["built"].median_ms
    if built_ms > EAGER_CHECK_TOLERANCE * eager_ms:
        module._fall_back(f"{MEASURED_SLOWER} ({built_ms:.3f} vs {eager_ms:.3f} ms per call): "
                          f"at this size the Python around and inside the captured graphs (aot_autograd's "
                          f"wrappers, one call per op) costs more than the passes save")
    return dict(measured_eager_ms=eager_ms, measured_built_ms=built_ms)
