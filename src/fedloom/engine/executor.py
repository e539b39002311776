"""Executors run the sampled clients' updates of one round. All executors must return the
same results for the same tasks; only how the work is scheduled differs."""

from __future__ import annotations

from typing import Protocol

import torch

from fedloom.algorithms.base import Algorithm, ClientResult, ClientTask, Message, State
from fedloom.config import ExecutorConfig
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.core.pytree import Tree
from fedloom.engine.evaluation import evaluate_each
from fedloom.engine.memory import keep_large_blocks_in_heap
from fedloom.engine.metrics import EvalCounts
from fedloom.errors import ConfigError


class Executor(Protocol):
    """Runs the sampled clients' local updates of one round.

    ``prepare`` is called once with every ClientData the run will use (so an executor can
    place data once: an arena for the vectorized executor, the object store for Ray);
    ``close`` once at the end of the run, also after an error.
    """

    name: str

    def prepare(self, clients: list[ClientData]) -> None: ...

    def close(self) -> None: ...

    def run_round(
        self,
        algorithm: Algorithm,
        message: Message,
        tasks: list[ClientTask],
        states: list[State | None],
    ) -> list[ClientResult]: ...

    def evaluate(
        self, models: list[tuple[Tree, Tree]], datas: list[ClientData], batch_size: int
    ) -> list[EvalCounts]:
        """Each (params, buffers) model on its client's held-out data."""
        ...


class SequentialExecutor:
    """The reference: one client after another in this process."""

    name = "sequential"

    def __init__(self, model: FunctionalModel | None = None) -> None:
        self.model = model
        # each client's result is fresh memory that lives until aggregation; kept in the heap
        # it is reused round after round instead of page-faulted in (W3: 28 -> 9 ms a round)
        keep_large_blocks_in_heap()

    def prepare(self, clients: list[ClientData]) -> None:
        pass

    def evaluate(
        self, models: list[tuple[Tree, Tree]], datas: list[ClientData], batch_size: int
    ) -> list[EvalCounts]:
        assert self.model is not None, "SequentialExecutor(model) is needed to evaluate"
        return evaluate_each(self.model, models, datas, batch_size)

    def close(self) -> None:
        pass

    def run_round(
        self,
        algorithm: Algorithm,
        message: Message,
        tasks: list[ClientTask],
        states: list[State | None],
    ) -> list[ClientResult]:
        return [algorithm.client_update(message, s, t) for t, s in zip(tasks, states, strict=True)]


def make_executor(config: ExecutorConfig, model: FunctionalModel) -> Executor:
    """The executor that ``executor.kind`` names (``workers`` > 1: in worker processes)."""
    if config.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("executor.device: 'cuda' was asked for but torch sees no CUDA device")
    if config.kind == "auto":
        from fedloom.engine.auto import AutoExecutor

        return AutoExecutor(model, config)
    if config.kind == "ray":
        from fedloom.engine.ray_executor import RayExecutor

        return RayExecutor(model, config)
    inner: Executor
    if config.kind == "sequential":
        if config.device != "cpu":
            raise ConfigError(
                "executor.device: the sequential executor runs on the CPU; use vectorized"
            )
        inner = SequentialExecutor(model)
    elif config.kind == "vectorized":
        from fedloom.engine.vectorized import VectorizedExecutor

        inner = VectorizedExecutor(model, config.chunk_size, config.memory_budget, config.device)
    else:
        raise ConfigError(f"executor.kind: unknown executor '{config.kind}'")
    if config.workers and config.workers > 1:
        if config.device != "cpu":
            raise ConfigError("executor.workers: worker processes run on the CPU only")
        from fedloom.engine.processes import MultiprocessExecutor

        return MultiprocessExecutor(inner, config.workers, config.threads or 1)
    return inner
