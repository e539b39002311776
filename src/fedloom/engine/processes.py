"""Worker processes on this machine: ``executor: {kind: sequential|vectorized, workers: N}``.

Each round's clients are split into N contiguous groups of about equal work (local steps):
this process trains the first group while N - 1 forked worker processes train the others,
each at ``threads`` intra-op threads (default 1). The workers are forked once per run after
the data is loaded, so every worker sees the clients' data without a copy; per round only the
server message, the work orders (client id and minibatch plan as one tensor) and the clients'
states travel to a worker, and the results travel back. With ``kind: vectorized`` each group
is one stacked program (core/stacked.py): the FedAvg paper's setting, 10 clients of B = 10,
runs 3.4x faster than one client at a time (benchmarks/README.md, "Auto's cost model").
Measured here (2 cores, torch 2.13): two 1-thread processes beat one 2-thread process on
MLP-sized models, where small per-client operations do not parallelize inside one process.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from fedloom.algorithms.base import Algorithm
from fedloom.core.protocol import ClientData, ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.engine.executor import States
from fedloom.engine.metrics import EvalCounts
from fedloom.engine.scheduling import balanced_groups
from fedloom.engine.threads import set_worker_threads, torch_threads
from fedloom.engine.transport import Packed, pack

_WORKER: dict[str, Any] = {}
"""Set in the parent just before the fork: the clients' data and the inner executor."""


PR_SET_PDEATHSIG = 1
"""prctl(2): the signal a process gets when its parent dies (Linux)."""


def _init_worker(threads: int, parent: int) -> None:
    """A forked worker's setup: its threads, and its end with the run's process. A worker
    waits for work on a pipe whose writing end it inherited, so a run killed outright
    (``kill -9``, out of memory) would otherwise leave it blocked there for good."""
    set_worker_threads(threads)
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the run died before prctl took effect
        os._exit(1)


KEPT = "algorithm"
"""The name under which the workers keep the algorithm they were forked with."""


def _call(work: Packed) -> Packed:
    """In a worker: the packed call ``fn(*args)``, its result packed (engine/transport.py)."""
    fn, args = work.unpack(_WORKER["kept"])
    return pack(fn(*args))


@dataclass(frozen=True)
class WorkOrder:
    """A task as it travels to a worker: no data (the worker has it), and the minibatch plan
    as one tensor of rows and the minibatch sizes. A plan of 48 small index tensors packed
    one by one cost 4 ms a round for 5 clients (benchmarks/README.md, "Auto's cost model")."""

    task: ClientTask
    rows: torch.Tensor
    sizes: list[int]

    @classmethod
    def of(cls, task: ClientTask) -> WorkOrder:
        rows = torch.cat(task.plan) if task.plan else torch.empty(0, dtype=torch.long)
        return cls(replace(task, data=None, plan=[]), rows, [len(b) for b in task.plan])

    def task_with(self, data: ClientData) -> ClientTask:
        return replace(self.task, data=data, plan=list(self.rows.split(self.sizes)))


def _tasks(orders: list[WorkOrder]) -> list[ClientTask]:
    clients: dict[int, ClientData] = _WORKER["clients"]
    return [order.task_with(clients[order.task.client_id]) for order in orders]


def _run_group(
    algorithm: Algorithm,
    message: Message,
    orders: list[WorkOrder],
    states: list[State | None],
) -> list[ClientResult]:
    return _WORKER["inner"].run_round(algorithm, message, _tasks(orders), states)


def _deploy_group(
    algorithm: Algorithm, server: State, states: list[State | None], orders: list[WorkOrder]
) -> list[tuple[Tree, Tree]]:
    return _WORKER["inner"].deployed_models(algorithm, server, states, _tasks(orders))


class MultiprocessExecutor:
    """Runs an inner executor (sequential or vectorized) in forked worker processes."""

    def __init__(self, inner: Any, workers: int, threads: int) -> None:
        self.inner = inner
        self.workers = workers
        self.threads = threads
        self.name = inner.name
        self.batches_clients: bool = inner.batches_clients
        self._pool: ProcessPoolExecutor | None = None
        self._clients: dict[int, ClientData] = {}
        self._algorithm: Algorithm | None = None
        self._kept: dict[int, str] = {}

    def prepare(self, clients: dict[int, ClientData]) -> None:
        """Prepare the inner executor and remember the clients (:meth:`remember`)."""
        self.inner.prepare(clients)
        self.remember(clients)

    def remember(self, clients: dict[int, ClientData]) -> None:
        """Remember the clients by id (the inner executor is prepared by its owner); the
        workers are forked at the first round."""
        self._clients = dict(clients)

    def _start(self, algorithm: Algorithm) -> ProcessPoolExecutor:
        """The worker processes, forked at the first call with ``algorithm``, which they keep
        (as Ray's workers keep theirs, engine/ray_executor.py: an algorithm's state lives in
        the server's and the clients' states, not in itself). Packing it for every call
        would visit its tables of one entry per client (the clients' sample counts), each
        entry a call of the packer: 0.3 s a round with 100,000 clients (docs/population.md)."""
        if self._pool is None:
            self._kept = {id(algorithm): KEPT}
            self._algorithm = algorithm  # alive, so that its id() stays its own
            _WORKER.update(clients=self._clients, inner=self.inner, kept={KEPT: algorithm})
            self._pool = ProcessPoolExecutor(
                self.workers - 1,  # this process is the N-th (_spread)
                mp_context=multiprocessing.get_context("fork"),
                initializer=_init_worker,
                initargs=(self.threads, os.getpid()),
            )
        return self._pool

    def _submit(self, fn: Callable[..., Any], algorithm: Algorithm, *args: Any) -> Future[Packed]:
        """``fn(algorithm, *args)`` in a worker. Call and result travel packed
        (engine/transport.py): the clients' states are rows of the state store's tables
        (memory-mapped files with ``state.storage: mmap``), which torch's own pickling cannot
        hand to another process; the algorithm the workers were forked with travels as its
        name."""
        pool = self._start(algorithm)
        return pool.submit(_call, pack((fn, (algorithm, *args)), self._kept))

    def _forked_with(self, tasks: list[ClientTask]) -> bool:
        """Whether every task's data is what the workers were (or will be) forked with."""
        return all(self._clients.get(t.client_id) is t.data for t in tasks)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None
        _WORKER.clear()
        self._algorithm, self._kept = None, {}

    def run_round(
        self, algorithm: Algorithm, message: Message, tasks: list[ClientTask], states: States
    ) -> list[ClientResult]:
        if not self._forked_with(tasks):  # data the workers do not hold: run here
            return self.inner.run_round(algorithm, message, tasks, states)
        groups = balanced_groups([len(algorithm.client_plan(t)) for t in tasks], self.workers)
        return self._spread(
            groups,
            lambda g: self.inner.run_round(
                algorithm, message, [tasks[i] for i in g], [states[i] for i in g]
            ),
            lambda g: self._submit(
                _run_group,
                algorithm,
                message,
                [WorkOrder.of(tasks[i]) for i in g],
                [states[i] for i in g],
            ),
        )

    def deployed_models(
        self, algorithm: Algorithm, server: State, states: States, tasks: list[ClientTask]
    ) -> list[tuple[Tree, Tree]]:
        """Deployments that train (fine-tuning) spread over the processes; the others here
        (reading a client's stored model costs less than shipping it)."""
        if not algorithm.deployment.trains() or not self._forked_with(tasks):
            return self.inner.deployed_models(algorithm, server, states, tasks)
        groups = balanced_groups([1] * len(tasks), self.workers)
        return self._spread(
            groups,
            lambda g: self.inner.deployed_models(
                algorithm, server, [states[i] for i in g], [tasks[i] for i in g]
            ),
            lambda g: self._submit(
                _deploy_group,
                algorithm,
                server,
                [states[i] for i in g],
                [WorkOrder.of(tasks[i]) for i in g],
            ),
        )

    def _spread(
        self,
        groups: list[range],
        here: Callable[[range], list[Any]],
        there: Callable[[range], Future[Packed]],
    ) -> list[Any]:
        """The groups' results in order: every group but the first goes to a worker, and this
        process works the first meanwhile (with the workers' thread count) instead of
        waiting: N-way parallel with N - 1 forked workers, and one group that never
        travels."""
        if not groups:
            return []
        futures = [there(g) for g in groups[1:]]
        with torch_threads(self.threads):
            first = here(groups[0])
        return first + [r for f in futures for r in f.result().unpack()]

    def evaluate(
        self, models: list[tuple[Tree, Tree]], datas: list[ClientData], batch_size: int
    ) -> list[EvalCounts]:
        return self.inner.evaluate(models, datas, batch_size)
