"""``executor.kind: auto``: pick the sequential (lean) executor, the vectorized executor, or
sequential in one worker process per core, and the thread count, for this model and data by
timing a few local steps of each on the first round.

Tiny models win big from vmap (thousands of clients per call); large convolutional models do
not (grouped convolutions under vmap are slower than one client at a time), and in between it
depends on the machine. Timing the real model on the real minibatches decides. The choice is
made once, reported in ``choice`` (and in the run summary), and kept in checkpoints so that a
resumed run continues on the same executor.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from typing import Any

import torch

from fedloom.algorithms.base import Algorithm, ClientResult, ClientTask, Message, State
from fedloom.config import ExecutorConfig
from fedloom.data.federated import ClientData
from fedloom.engine.executor import SequentialExecutor
from fedloom.engine.functional import FunctionalModel
from fedloom.engine.metrics import EvalCounts
from fedloom.engine.processes import MultiprocessExecutor
from fedloom.engine.pytree import Tree
from fedloom.engine.vectorized import VectorizedExecutor
from fedloom.errors import ConfigError

PROBE_STEPS = 2
PROBE_CLIENTS = 8


class AutoExecutor:
    name = "auto"

    def __init__(self, model: FunctionalModel, config: ExecutorConfig) -> None:
        self.model = model
        self.config = config
        self.sequential = SequentialExecutor(model)
        self.vectorized: VectorizedExecutor | None = None
        try:
            self.vectorized = VectorizedExecutor(
                model, config.chunk_size, config.memory_budget, config.device
            )
        except ConfigError:
            if config.device == "cuda":
                raise
            # a model vmap cannot reproduce (dropout): the other candidates only
        cores = os.cpu_count() or 1
        self.processes: MultiprocessExecutor | None = None
        if cores > 1 and config.device == "cpu":
            workers = config.workers or cores
            self.processes = MultiprocessExecutor(SequentialExecutor(model), workers, 1)
        self.choice: str | None = None
        """'sequential/threads=T', 'vectorized/threads=T' or 'processes=N/threads=1'."""
        self.timings: dict[str, float] = {}

    def prepare(self, clients: list[ClientData]) -> None:
        for executor in (self.vectorized, self.processes):
            if executor is not None:
                executor.prepare(clients)

    def close(self) -> None:
        for executor in (self.vectorized, self.processes):
            if executor is not None:
                executor.close()

    def _executor(self, kind: str) -> Any:
        if kind == "sequential":
            return self.sequential
        if kind == "vectorized":
            assert self.vectorized is not None
            return self.vectorized
        assert self.processes is not None
        return self.processes

    def evaluate(
        self, models: list[tuple[Tree, Tree]], datas: list[ClientData], batch_size: int
    ) -> list[EvalCounts]:
        chosen = (
            self.sequential if (self.choice or "").startswith("sequential") else self.vectorized
        )
        return chosen.evaluate(models, datas, batch_size)

    def _candidates(self) -> list[tuple[str, int]]:
        """One thread per process by default (small per-client operations do not speed up
        with more and collapse when the cores are shared); the vectorized executor's large
        batched operations also get all cores; and one 1-thread worker process per core."""
        cores = os.cpu_count() or 1
        threads = [self.config.threads] if self.config.threads else [1]
        candidates = []
        if self.vectorized is not None:
            candidates = [
                ("vectorized", t) for t in sorted({*threads, self.config.threads or cores})
            ]
        if self.config.device != "cuda":
            candidates = [("sequential", t) for t in threads] + candidates
        if self.processes is not None:
            candidates.append((f"processes={self.processes.workers}", 1))
        return candidates

    def _probe(
        self,
        algorithm: Algorithm,
        message: Message,
        tasks: list[ClientTask],
        states: list[State | None],
    ) -> str:
        """Seconds per client-step of each candidate on the first clients' first minibatches."""
        sample = [
            (replace(t, plan=algorithm.client_plan(t)[:PROBE_STEPS]), s)
            for t, s in zip(tasks[:PROBE_CLIENTS], states[:PROBE_CLIENTS], strict=True)
        ]
        probe_tasks = [t for t, _ in sample]
        probe_states = [s for _, s in sample]
        work = sum(len(t.plan) for t in probe_tasks) or 1
        before = torch.get_num_threads()
        try:
            for kind, threads in self._candidates():
                torch.set_num_threads(threads)
                executor = self._executor(kind)
                best = float("inf")
                for _ in range(2):  # the first call also warms up
                    start = time.perf_counter()
                    # results are discarded: executors never write client states themselves
                    executor.run_round(algorithm, message, probe_tasks, probe_states)
                    best = min(best, time.perf_counter() - start)
                self.timings[f"{kind}/threads={threads}"] = best / work
        finally:
            torch.set_num_threads(before)
        return min(self.timings, key=self.timings.__getitem__)

    def run_round(
        self,
        algorithm: Algorithm,
        message: Message,
        tasks: list[ClientTask],
        states: list[State | None],
    ) -> list[ClientResult]:
        if not tasks:
            return []
        if self.choice is None:
            self.choice = self._probe(algorithm, message, tasks, states)
            if self.processes is not None and not self.choice.startswith("processes"):
                self.processes.close()  # not chosen: release the worker processes
        kind, threads = self.choice.split("/threads=")
        executor = self._executor(kind)
        before = torch.get_num_threads()
        torch.set_num_threads(int(threads))
        try:
            return executor.run_round(algorithm, message, tasks, states)
        finally:
            torch.set_num_threads(before)
