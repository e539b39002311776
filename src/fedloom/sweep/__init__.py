"""Sweeps (``fedloom sweep``, docs/benchmarks.md): a grid of configs at several seeds, each
run in its own process or Ray task, restartable, summarized as the tables a paper prints."""

from fedloom.sweep.run import SweepResult, sweep
from fedloom.sweep.spec import Sweep, load_spec, parse_spec

__all__ = ["Sweep", "SweepResult", "load_spec", "parse_spec", "sweep"]
