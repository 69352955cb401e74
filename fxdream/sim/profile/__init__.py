"""Measuring ops on this machine for ``Profiled``: in-context timing of graphs, host overheads,
CUDA timing, profile keys, and the store that keeps measurements for the process."""
