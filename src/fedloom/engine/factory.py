"""The one place executors are made: a numerics backend (sequential: the lean trainer and the
autograd backend, one client at a time; vectorized: the vmap backend, a chunk at a time) and
where it runs (this process, forked worker processes, Ray actors), or ``auto``'s choice. The
config was checked when it was parsed (config.ExecutorConfig)."""

from __future__ import annotations

from fedloom.core.functional import FunctionalModel
from fedloom.engine.auto import AutoExecutor
from fedloom.engine.executor import Executor
from fedloom.engine.processes import MultiprocessExecutor
from fedloom.engine.ray_executor import RayExecutor
from fedloom.engine.sequential import SequentialExecutor
from fedloom.engine.vectorized import VectorizedExecutor
from fedloom.run_config.executor import ExecutorConfig


def make_executor(config: ExecutorConfig, model: FunctionalModel) -> Executor:
    """The executor that ``executor.kind`` names (``workers`` > 1: in worker processes)."""
    if config.kind == "auto":
        return AutoExecutor(model, config)
    if config.kind == "ray":
        return RayExecutor(model, config)
    inner: Executor
    if config.kind == "sequential":
        inner = SequentialExecutor(model)
    else:
        inner = VectorizedExecutor(model, config.chunk_size, config.memory_budget, config.device)
    if config.workers and config.workers > 1:
        return MultiprocessExecutor(inner, config.workers, config.threads or 1)
    return inner
