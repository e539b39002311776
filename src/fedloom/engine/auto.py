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

from fedloom.algorithms.base import Algorithm
from fedloom.config import ExecutorConfig
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData, ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.engine.executor import States
from fedloom.engine.metrics import EvalCounts
from fedloom.engine.processes import MultiprocessExecutor
from fedloom.engine.sequential import SequentialExecutor
from fedloom.engine.threads import torch_threads
from fedloom.engine.vectorized import VectorizedExecutor
from fedloom.errors import ConfigError

PROBE_STEPS = 4
PROBE_CLIENTS = 8
PROBE_MAX_REPEATS = 5
PROBE_SECONDS = 0.3
"""Each candidate's short and long probes are repeated (the fastest kept) until about this
much time was spent on them, at most PROBE_MAX_REPEATS times."""
PROBE_VECTOR_SECONDS = 2.0
"""The vectorized candidate probes as many clients as fit about this long a pass."""


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

    def prepare(self, clients: dict[int, ClientData]) -> None:
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
        """One thread and all cores for each in-process executor (small per-client operations
        do not speed up with more threads and collapse when the cores are shared; a CNN's
        convolutions do), and one 1-thread worker process per core."""
        cores = os.cpu_count() or 1
        threads = sorted({self.config.threads or 1, self.config.threads or cores})
        candidates = []
        if self.vectorized is not None:
            candidates = [("vectorized", t) for t in threads]
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
        """Estimated seconds per client of each candidate on this round's clients.

        Each candidate runs the first clients with plans cut to 1 and to PROBE_STEPS steps;
        the line through the two timings, a + b * steps, separates what a client costs once
        (worker processes ship a CNN's 6.6 MB result back per client, vmap stacks a chunk)
        from what each step costs, and is evaluated at the round's mean number of steps.
        Timing short plans per step alone misjudged candidates with large per-client costs
        (FedAvg CNN: it ranked worker processes behind one 2-thread process, the wrong way
        round). One-at-a-time candidates run PROBE_CLIENTS clients; the vectorized one runs as
        many as its chunk will hold (up to PROBE_VECTOR_SECONDS of probing), since a chunk of 8
        says little about a chunk of 1,000 (W3: 8 clients made the sequential executor look
        faster than the vectorized one, which wins at the round's 1,000). Numbers in
        benchmarks/README.md, Design measurements."""
        plans = [algorithm.client_plan(t) for t in tasks]
        steps = sum(len(p) for p in plans) / len(plans)

        def probe(n: int) -> tuple[list[ClientTask], list[ClientTask]]:
            """The first n clients with plans cut to 1 and to PROBE_STEPS steps."""
            head = list(zip(tasks[:n], plans, strict=False))
            return (
                [replace(t, plan=p[:1]) for t, p in head],
                [replace(t, plan=p[:PROBE_STEPS]) for t, p in head],
            )

        small = probe(PROBE_CLIENTS)
        max_batch = max((b.shape[0] for p in plans for b in p), default=1)
        for kind, threads in self._candidates():
            # timed under the thread count (and the process's OpenMP wait policy) that the
            # run will use if it wins, so a busy neighbour shows in the timings
            with torch_threads(threads):
                executor = self._executor(kind)

                def timed(work: list[ClientTask], executor: Any = executor) -> float:
                    start = time.perf_counter()
                    # results are discarded: executors never write client states themselves
                    executor.run_round(algorithm, message, work, states[: len(work)])
                    return (time.perf_counter() - start) / len(work)

                first = timed(small[0])  # warm-up: first calls, worker start
                short, long = small
                if kind == "vectorized":
                    n = min(len(tasks), executor.chunk_size(tasks, max_batch))
                    affordable = PROBE_VECTOR_SECONDS / max(first * (1 + PROBE_STEPS), 1e-9)
                    n = min(n, max(len(short), int(affordable)))
                    if n > len(short):
                        short, long = probe(n)
                        timed(short)  # warm-up at the chunk's size
                t_short, t_long = timed(short), timed(long)
                spent, repeats = t_short + t_long, 1
                while repeats < PROBE_MAX_REPEATS and spent * len(short) < PROBE_SECONDS:
                    # the fastest of a few: noise on a shared machine only adds time
                    a, b = timed(short), timed(long)
                    t_short, t_long = min(t_short, a), min(t_long, b)
                    spent, repeats = spent + a + b, repeats + 1
                k_long = sum(len(t.plan) for t in long) / len(long)
                if k_long > 1:
                    per_step = max(0.0, (t_long - t_short) / (k_long - 1))
                    once = max(0.0, t_short - per_step)
                else:  # one-step plans (FedSGD): nothing to separate, the round is one step
                    per_step, once = 0.0, min(t_short, t_long)
                self.timings[f"{kind}/threads={threads}"] = once + per_step * steps
        return min(self.timings, key=self.timings.__getitem__)

    def run_round(
        self, algorithm: Algorithm, message: Message, tasks: list[ClientTask], states: States
    ) -> list[ClientResult]:
        if not tasks:
            return []
        if self.choice is None:
            self.choice = self._probe(algorithm, message, tasks, states)
            if self.processes is not None and not self.choice.startswith("processes"):
                self.processes.close()  # not chosen: release the worker processes
        kind, threads = self.choice.split("/threads=")
        with torch_threads(int(threads)):
            return self._executor(kind).run_round(algorithm, message, tasks, states)
