"""The ServerApp: fedloom's own round loop (``fedloom.run``: sampling, budgets and stragglers,
message transforms, the algorithm's aggregation, evaluation, checkpoints, the run directory)
with an executor that sends each sampled client's work to the Flower node holding that client
and reads the replies back.

Nodes are matched to fedloom clients once, at the start: the server asks every connected node
(message type ``query``) for its ``partition-id`` and waits until every training client has a
node. Each round, a client's persistent state (SCAFFOLD's control variate ...) travels down
only when its node does not hold it yet; the node keeps it in its ``Context.state`` across
rounds (protocol.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flwr.app import Context, Message, MessageType, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedloom.algorithms.base import Algorithm
from fedloom.api import run as run_fedloom
from fedloom.config import RunConfig
from fedloom.core import pytree
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData, ClientResult, ClientTask, State
from fedloom.core.protocol import Message as FedMessage
from fedloom.core.pytree import Tree
from fedloom.engine.evaluation import evaluate_each
from fedloom.engine.executor import States
from fedloom.engine.metrics import EvalCounts
from fedloom.engine.sampling import POOLED_CLIENT
from fedloom.engine.shell import RunResult
from fedloom.errors import ConfigError
from fedloom.flower import protocol
from fedloom.flower.runtime import ConfigSource, DataFactory, ModelFactory

FLOWER_LOG = logging.getLogger("flwr")
"""Flower's logger: what the ServerApp logs there shows in ``flwr run --stream`` / ``flwr log``."""


class FlowerError(RuntimeError):
    """A Flower node failed, did not answer, or no node holds a client."""


def _raise_on_error(reply: Message, what: str) -> None:
    if reply.has_error():
        raise FlowerError(
            f"{what}: node {reply.metadata.src_node_id} failed: {reply.error.reason} "
            f"(code {reply.error.code})"
        )


def discover_nodes(grid: Grid, wanted: set[int], timeout: float) -> dict[int, int]:
    """fedloom client id -> Flower node id, for every client in ``wanted``: each connected node
    answers a ``query`` with the ``partition-id`` of its node config. Waits up to ``timeout``
    seconds for enough nodes to connect."""
    deadline = time.monotonic() + timeout
    nodes: dict[int, int] = {}
    asked: set[int] = set()
    while True:
        new = [n for n in grid.get_node_ids() if n not in asked]
        if new:
            queries = [
                Message(RecordDict(), dst_node_id=n, message_type=MessageType.QUERY) for n in new
            ]
            for reply in grid.send_and_receive(
                queries, timeout=max(1.0, deadline - time.monotonic())
            ):
                _raise_on_error(reply, "asking nodes for their partition-id")
                node = reply.metadata.src_node_id
                client = int(reply.content.config_records[protocol.NODE][protocol.PARTITION_ID])  # type: ignore[arg-type]
                if client in nodes and nodes[client] != node:
                    raise FlowerError(
                        f"partition-id {client} is held by two nodes ({nodes[client]} and {node}): "
                        "give each SuperNode its own --node-config 'partition-id=K'"
                    )
                nodes[client] = node
                asked.add(node)
        if wanted <= nodes.keys():
            return nodes
        if time.monotonic() > deadline:
            missing = sorted(wanted - nodes.keys())
            raise FlowerError(
                f"no Flower node holds client(s) {_short(missing)} after {timeout:.0f} s "
                f"({len(nodes)} node(s) answered); start one SuperNode per client with "
                "--node-config 'partition-id=K num-partitions=N'"
            )
        time.sleep(0.2)


def _short(ids: list[int]) -> str:
    return ", ".join(map(str, ids[:10])) + (" ..." if len(ids) > 10 else "")


class FlowerExecutor:
    """An engine executor (engine/executor.py) whose clients are Flower nodes. Evaluation runs
    on the server, as the engine's (the server loads the clients' held-out data too)."""

    name = "flower"
    batches_clients = False

    def __init__(
        self,
        grid: Grid,
        model: FunctionalModel | None = None,
        round_timeout: float | None = None,
        connect_timeout: float = 120.0,
    ) -> None:
        self.grid = grid
        self.model = model
        self.round_timeout = round_timeout
        self.connect_timeout = connect_timeout
        self.nodes: dict[int, int] = {}
        self.holding: set[int] = set()
        """Clients whose node holds their current state (nothing after a server restart)."""
        self.stats = {"nodes": 0, "messages": 0, "states_sent": 0, "state_bytes_down": 0}
        """What the adapter did: nodes matched, train messages sent, client states sent down
        and their bytes (states are not communication in fedloom's accounting)."""

    def prepare(self, clients: dict[int, ClientData]) -> None:
        if POOLED_CLIENT in clients:
            raise ConfigError(
                "algorithm.name: the centralized baseline trains on pooled data; it has no "
                "clients to run on Flower nodes"
            )
        self.nodes = discover_nodes(self.grid, set(clients), self.connect_timeout)
        self.stats["nodes"] = len(self.nodes)

    def close(self) -> None:
        pass

    def run_round(
        self, algorithm: Algorithm, message: FedMessage, tasks: list[ClientTask], states: States
    ) -> list[ClientResult]:
        if not tasks:
            return []
        shared = protocol.message_content(message)
        out = []
        for task, state in zip(tasks, states, strict=True):
            mode: protocol.StateMode = "none"
            if state is not None:
                mode = "node" if task.client_id in self.holding else "sent"
            content = protocol.train_content(shared, task, state, mode)
            if mode == "sent":
                assert state is not None
                self.stats["states_sent"] += 1
                self.stats["state_bytes_down"] += sum(pytree.num_bytes(t) for t in state.values())
            out.append(
                Message(
                    content,
                    dst_node_id=self.nodes[task.client_id],
                    message_type=MessageType.TRAIN,
                    group_id=str(task.round),
                )
            )
        self.stats["messages"] += len(out)
        replies = self.grid.send_and_receive(out, timeout=self.round_timeout)
        results: dict[int, ClientResult] = {}
        for reply in replies:
            _raise_on_error(reply, f"round {tasks[0].round}")
            result = protocol.read_reply(reply.content)
            results[result.client_id] = result
        missing = [t.client_id for t in tasks if t.client_id not in results]
        if missing:
            raise FlowerError(
                f"round {tasks[0].round}: no reply from client(s) {_short(missing)} within "
                f"{self.round_timeout} s"
            )
        self.holding |= {t.client_id for t, s in zip(tasks, states, strict=True) if s is not None}
        return [results[t.client_id] for t in tasks]  # the engine's order: same sums

    def evaluate(
        self, models: list[tuple[Tree, Tree]], datas: list[ClientData], batch_size: int
    ) -> list[EvalCounts]:
        assert self.model is not None
        return evaluate_each(self.model, models, datas, batch_size)

    def deployed_models(
        self, algorithm: Algorithm, server: State, states: States, tasks: list[ClientTask]
    ) -> list[tuple[Tree, Tree]]:
        """On the server, as ``evaluate``."""
        return algorithm.deployment.deployed_models(server, states, tasks)


@dataclass
class FedloomServer:
    """The ServerApp's main function: ``fedloom.run`` of the config on the Flower grid. Its
    result (summary, history, models) is kept in ``result``."""

    source: ConfigSource
    out: str | Path | None = None
    write: bool = True
    resume: str | Path | None = None
    round_timeout: float | None = None
    connect_timeout: float = 120.0
    result: RunResult | None = field(default=None, init=False)
    executor: FlowerExecutor | None = field(default=None, init=False)

    def config(self, context: Context) -> RunConfig:
        return self.source.resolve(context.run_config)

    def __call__(self, grid: Grid, context: Context) -> None:
        def executor(model: FunctionalModel) -> FlowerExecutor:
            self.executor = FlowerExecutor(grid, model, self.round_timeout, self.connect_timeout)
            return self.executor

        result = run_fedloom(
            None if self.resume is not None else self.config(context),
            data=self.source.load_data(),
            model=self.source.load_model(),
            out=self.out,
            write=self.write,
            resume=self.resume,
            progress=False,
            executor=executor,
        )
        assert self.executor is not None
        result.extras = {**result.extras, "flower": dict(self.executor.stats)}
        self.result = result
        final = result.summary["final"]
        FLOWER_LOG.info(
            "fedloom %s: %d rounds on %d Flower nodes; global %s; personalized %s",
            result.summary["algorithm"],
            result.summary["rounds"],
            self.executor.stats["nodes"],
            final["global"],
            {k: v for k, v in final["personalized"].items() if k.endswith("mean")},
        )


def server_app(
    config: RunConfig | Mapping[str, Any] | str | Path | None = None,
    *,
    data: DataFactory | None = None,
    model: ModelFactory | None = None,
    out: str | Path | None = None,
    write: bool = True,
    resume: str | Path | None = None,
    round_timeout: float | None = None,
    connect_timeout: float = 120.0,
) -> ServerApp:
    """A Flower ``ServerApp`` that runs ``config`` (a YAML path, a dict or a RunConfig) with
    fedloom's round loop, its clients' work done by the ClientApps of :func:`client_app`.

    ``data`` / ``model``: zero-argument callables returning the user's FederatedData and torch
    module (the same on the ClientApp). ``out`` / ``write``: the run directory, as
    ``fedloom.run``; ``resume``: continue that run directory from its last checkpoint (its
    saved config; the nodes get their clients' states again). ``round_timeout``: seconds to
    wait for a round's replies (None: no limit); ``connect_timeout``: for the nodes of every
    training client to connect."""
    server = FedloomServer(
        ConfigSource.of(config, data, model),
        out=out,
        write=write,
        resume=resume,
        round_timeout=round_timeout,
        connect_timeout=connect_timeout,
    )
    app = ServerApp()
    app.main()(server)
    app.fedloom_server = server  # type: ignore[attr-defined]
    return app
