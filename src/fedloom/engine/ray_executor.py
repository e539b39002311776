"""The Ray executor: a round's clients spread over ``executor.workers`` Ray actors, possibly on
several machines (docs/ray.md).

Every client's data goes to the actors once, in ``prepare``, through Ray's object store; a
round then ships only the server's message (put once per round, shared by all actors), the
algorithm (put once per run) and per client a light work order: data index, client id, batch
plan, learning rate, round and state. Each actor runs the sequential executor (the vectorized
one when ``executor.chunk_size`` is set) on a contiguous group of the round's clients, so the
numbers equal the sequential executor's up to float noise.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
from dataclasses import replace
from typing import Any

import torch

from fedloom.algorithms.base import Algorithm
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData, ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.engine.executor import States
from fedloom.engine.metrics import EvalCounts
from fedloom.engine.scheduling import balanced_groups
from fedloom.engine.sequential import SequentialExecutor
from fedloom.engine.threads import set_worker_threads
from fedloom.errors import ConfigError
from fedloom.run_config.executor import ExecutorConfig

MIN_OBJECT_STORE = 256 * 1024**2
"""Object store of a Ray runtime the executor starts itself (grown to fit the data)."""
CONNECT_TIMEOUT_S = 5.0
"""How long the GCS port of ``executor.address`` may take to accept a TCP connection."""
ACTOR_START_TIMEOUT_S = 120.0
"""How long the workers may take to start (pending for lack of CPUs: an error)."""


def compact(obj: Any) -> Any:
    """``obj`` with every tensor that views a larger storage replaced by a copy of just its
    elements (recursing into dicts, lists and tuples). Pickling a view writes its whole
    storage: a client's data slice of the full dataset, a batch of a permutation, a client's
    row of a stacked chunk would each travel at full size."""
    if isinstance(obj, torch.Tensor):
        if obj.untyped_storage().nbytes() <= obj.numel() * obj.element_size():
            return obj
        copy = obj.detach().clone(memory_format=torch.contiguous_format)
        return copy.requires_grad_(obj.requires_grad) if obj.is_floating_point() else copy
    if isinstance(obj, dict):
        return {k: compact(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [compact(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(compact(v) for v in obj)
    return obj


def compact_client(c: ClientData) -> ClientData:
    return ClientData(compact(c.x_train), compact(c.y_train), compact(c.x_test), compact(c.y_test))


class RayWorker:
    """The body of one Ray actor: holds every client's data, runs groups of client updates."""

    def __init__(
        self,
        clients: dict[int, ClientData],
        threads: int,
        chunk_size: int | None,
        memory_budget: str | None,
    ) -> None:
        import ray

        set_worker_threads(threads)
        self.clients = clients
        self.chunk_size = chunk_size
        self.memory_budget = memory_budget
        self.node_id: str = ray.get_runtime_context().get_node_id()
        self._algorithm_key: str | None = None
        self._algorithm: Algorithm | None = None
        self._inner: Any = None

    def ready(self) -> str:
        """The id of the node this actor runs on (also: the actor has started)."""
        return self.node_id

    def _load(self, boxed_algorithm: list[Any]) -> tuple[Algorithm, Any]:
        """The run's algorithm (fetched once per run: the ref comes boxed, so Ray does not
        resolve it on every call) and the executor that runs it here."""
        import ray

        from fedloom.engine.sequential import SequentialExecutor

        ref = boxed_algorithm[0]
        if ref.hex() != self._algorithm_key:
            algorithm: Algorithm = ray.get(ref)
            if self.chunk_size is not None:
                from fedloom.engine.vectorized import VectorizedExecutor

                self._inner = VectorizedExecutor(
                    algorithm.ctx.model, self.chunk_size, self.memory_budget, "cpu"
                )
            else:
                self._inner = SequentialExecutor(algorithm.ctx.model)
            self._algorithm, self._algorithm_key = algorithm, ref.hex()
        assert self._algorithm is not None
        return self._algorithm, self._inner

    def run(
        self,
        boxed_algorithm: list[Any],
        message: Message,
        tasks: list[ClientTask],
        states: list[State | None],
    ) -> tuple[str, list[ClientResult]]:
        """Run one group of client updates; returns (node id, results in task order)."""
        algorithm, inner = self._load(boxed_algorithm)
        full = [replace(t, data=self.clients[t.client_id]) for t in tasks]
        results = inner.run_round(algorithm, message, full, states)
        return self.node_id, [
            replace(r, upload=compact(r.upload), state=compact(r.state)) for r in results
        ]


def _check_reachable(address: str) -> None:
    """Raise ConfigError unless ``host:port`` accepts a TCP connection (a fast check before
    Ray's own, much slower, connect timeout)."""
    hostport = address.split("://", 1)[-1]
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(
            f"executor.address: '{address}' is not HOST:PORT (e.g. 'head-node:6379') or 'auto'"
        )
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S):
            pass
    except OSError as err:
        raise ConfigError(
            f"executor.address: cannot connect to the Ray cluster at '{address}' ({err}); "
            f"is `ray start --head` running there and the port open?"
        ) from None


class RayExecutor:
    """Runs each round's clients on ``executor.workers`` Ray actors (one CPU each)."""

    name = "ray"
    batches_clients = False

    def __init__(self, model: FunctionalModel, config: ExecutorConfig) -> None:
        # parse_config checked that Ray is installed and that the device is the CPU
        self.model = model
        self.config = config
        self.driver = SequentialExecutor(model)
        """Evaluation and deployments run here on the driver: the deployed models live here,
        and a forward pass is cheap next to the local training the workers do."""
        self.started_ray = False
        self.actors: list[Any] = []
        self.actor_nodes: list[str] = []
        self._data_ref: Any = None
        self._clients: dict[int, ClientData] = {}
        self._algorithm: Algorithm | None = None
        self._algorithm_ref: Any = None
        self.message_puts = 0
        """How many messages went into the object store (one per round)."""
        self.round_nodes: list[list[str]] = []
        """Per round, the node id each group of clients ran on."""

    # -- lifecycle ------------------------------------------------------------------------
    def _connect(self, data_bytes: int) -> None:
        import ray

        if ray.is_initialized():
            return
        address = self.config.address
        quiet = {"logging_level": logging.WARNING, "configure_logging": True}
        if address:
            if address != "auto":
                _check_reachable(address)
            try:
                ray.init(address=address, **quiet)
            except Exception as err:  # Ray raises several types (ConnectionError, ...)
                raise ConfigError(
                    f"executor.address: cannot connect to the Ray cluster at '{address}': {err}"
                ) from None
        else:
            cpus = max(os.cpu_count() or 1, self.config.workers or 1)
            store = max(MIN_OBJECT_STORE, 2 * data_bytes + 64 * 1024**2)
            ray.init(
                num_cpus=cpus,
                include_dashboard=False,
                object_store_memory=store,
                **quiet,
            )
        self.started_ray = True

    def prepare(self, clients: dict[int, ClientData]) -> None:
        """Connect to (or start) Ray, put the clients' data once, start the workers."""
        try:
            self._prepare(clients)
        except BaseException:
            self.close()  # the engine only closes an executor that prepared successfully
            raise

    def _prepare(self, clients: dict[int, ClientData]) -> None:
        import ray

        data_bytes = sum(
            t.numel() * t.element_size()
            for c in clients.values()
            for t in (c.x_train, c.y_train, c.x_test, c.y_test)
        )
        self._connect(data_bytes)
        cluster_cpus = int(ray.cluster_resources().get("CPU", 0))
        workers = self.config.workers or max(1, cluster_cpus)
        if workers > cluster_cpus:
            raise ConfigError(
                f"executor.workers: {workers} workers need {workers} CPUs, but the Ray cluster "
                f"has {cluster_cpus}; lower executor.workers or add nodes"
            )
        self._clients = dict(clients)
        self._data_ref = ray.put({cid: compact_client(c) for cid, c in clients.items()})
        remote = ray.remote(num_cpus=1)(RayWorker)
        self.actors = [
            remote.remote(
                self._data_ref,
                self.config.threads or 1,
                self.config.chunk_size,
                self.config.memory_budget,
            )
            for _ in range(workers)
        ]
        pending = [a.ready.remote() for a in self.actors]
        done, _ = ray.wait(pending, num_returns=len(pending), timeout=ACTOR_START_TIMEOUT_S)
        if len(done) < len(pending):
            raise ConfigError(
                f"executor.workers: only {len(done)} of {workers} Ray workers started within "
                f"{ACTOR_START_TIMEOUT_S:.0f} s (not enough free CPUs in the cluster?)"
            )
        self.actor_nodes = ray.get(pending)

    def close(self) -> None:
        """Kill the workers; shut Ray down only if this executor started it."""
        try:
            import ray
        except ImportError:
            return
        for actor in self.actors:
            with contextlib.suppress(Exception):  # already dead, or the cluster went away
                ray.kill(actor)
        self.actors = []
        self._data_ref = self._algorithm_ref = self._algorithm = None
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False

    def evaluate(
        self, models: list[tuple[Tree, Tree]], datas: list[ClientData], batch_size: int
    ) -> list[EvalCounts]:
        return self.driver.evaluate(models, datas, batch_size)

    def deployed_models(
        self, algorithm: Algorithm, server: State, states: States, tasks: list[ClientTask]
    ) -> list[tuple[Tree, Tree]]:
        return self.driver.deployed_models(algorithm, server, states, tasks)

    # -- the round ------------------------------------------------------------------------
    def run_round(
        self, algorithm: Algorithm, message: Message, tasks: list[ClientTask], states: States
    ) -> list[ClientResult]:
        import ray

        if not tasks:
            return []
        if not self.actors:
            raise RuntimeError("RayExecutor.run_round called before prepare()")
        if algorithm is not self._algorithm:
            self._algorithm, self._algorithm_ref = algorithm, ray.put(algorithm)
        message_ref = ray.put(compact(message))
        self.message_puts += 1
        light = []
        for t in tasks:
            if self._clients.get(t.client_id) is not t.data:
                raise RuntimeError(
                    f"client {t.client_id}'s data was not given to RayExecutor.prepare()"
                )
            light.append(replace(t, data=None, plan=compact(t.plan)))  # the worker has the data
        groups = balanced_groups([max(1, len(t.plan)) for t in tasks], len(self.actors))
        futures = [
            actor.run.remote(
                [self._algorithm_ref],
                message_ref,
                [light[i] for i in group],
                [compact(states[i]) for i in group],
            )
            for actor, group in zip(self.actors, groups, strict=False)
        ]
        results: list[ClientResult] = []
        nodes: list[str] = []
        for node, part in ray.get(futures):
            nodes.append(node)
            results.extend(part)
        self.round_nodes.append(nodes)
        return results
