"""A build's progress lines: the fxdream logger at INFO (the CLI's are in test_cli)."""
import logging

import torch

import fxdream
from fxdream.build import built_by_fxdream
from fxdream.sim.profile.host_timing import measure_graph_call_us
from test_optimize import Small


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_a_build_logs_its_progress_at_info_and_its_probes_do_not():
    log, lines = logging.getLogger("fxdream"), _Lines()
    level = log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        fxdream.optimize(Small().eval(), (torch.randn(2, 3, 8, 8),), passes=["reinplace"], cost=None)
        measure_graph_call_us(torch.device("cpu"), built_by_fxdream)  # builds a one-op module of its own
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    assert lines.lines[0] == "building Small (inference, cpu, passes: reinplace) ..."
    assert lines.lines[1].startswith("pass reinplace on 0/fw: ")
    assert lines.lines[2].startswith("built Small in ") and "(torch.fx symbolic_trace)" in lines.lines[2]
    assert len(lines.lines) == 3  # nothing from the probe's build
