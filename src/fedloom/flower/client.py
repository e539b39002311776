"""The ClientApp: one fedloom client per Flower node (its ``partition-id``).

On a ``train`` message the node rebuilds the client's work order from the run's config (its
data, the plan from the (seed, round, client, "batches") stream, ``steps`` as the server
decided) and runs the algorithm's client program with fedloom's sequential solver, exactly
what the engine's sequential executor runs. Its persistent state lives in the node's
``Context.state`` across rounds (Flower's simulation keeps each node's context between
messages; a SuperNode keeps it for the run).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedloom.config import RunConfig
from fedloom.core.protocol import State
from fedloom.engine.threads import torch_threads
from fedloom.errors import ConfigError
from fedloom.flower import protocol
from fedloom.flower.records import drop_trees, get_trees, put_trees
from fedloom.flower.runtime import ConfigSource, DataFactory, ModelFactory, client_runtime

NODE_STATE = "fedloom.state"
"""Namespace of the client's persistent state in the node's ``Context.state``."""


def partition_id(context: Context) -> int:
    """The fedloom client this node holds (its node config's ``partition-id``)."""
    value = context.node_config.get(protocol.PARTITION_ID)
    if value is None:
        raise ConfigError(
            "this Flower node has no 'partition-id' in its node config: start the SuperNode "
            "with --node-config 'partition-id=K num-partitions=N' (K: the fedloom client id)"
        )
    return int(value)  # type: ignore[arg-type]


def _state(order: protocol.TrainOrder, context: Context) -> State | None:
    """The client's state for this round: none, the one the server sent (the node's first
    round, or after the server resumed), or the one the node kept."""
    if order.mode == "none":
        return None
    if order.mode == "sent":
        return order.state
    kept = get_trees(context.state, NODE_STATE)
    if kept is None:
        raise RuntimeError(
            f"client {order.client}: the server expects this node to hold the client's state, "
            "but it has none (the node restarted during the run); restart the run or resume it "
            "on the server so that it sends the state again"
        )
    return kept


def train(source: ConfigSource, message: Message, context: Context) -> Message:
    """One round of the client: its program on the sequential solver, the reply."""
    order = protocol.read_train(message.content)
    client = partition_id(context)
    if client != order.client:
        raise RuntimeError(f"a task for client {order.client} reached the node of client {client}")
    runtime = client_runtime(source, context.run_config)
    task = runtime.task(client, order.round, order.steps, order.full)
    state = _state(order, context)
    algorithm = runtime.engine.algorithm
    with torch_threads(runtime.threads):
        (result,) = runtime.executor.run_round(algorithm, order.message, [task], [state])
    if result.state is not None:
        drop_trees(context.state, NODE_STATE)
        put_trees(context.state, NODE_STATE, result.state)
    return Message(protocol.reply_content(result), reply_to=message)


def query(message: Message, context: Context) -> Message:
    """Which fedloom client this node holds (the server's handshake)."""
    content = RecordDict(
        {protocol.NODE: ConfigRecord({protocol.PARTITION_ID: partition_id(context)})}
    )
    return Message(content, reply_to=message)


def client_app(
    config: RunConfig | Mapping[str, Any] | str | Path | None = None,
    *,
    data: DataFactory | None = None,
    model: ModelFactory | None = None,
) -> ClientApp:
    """A Flower ``ClientApp`` for the fedloom run ``config`` (the same config, ``data`` and
    ``model`` as the :func:`~fedloom.flower.server_app`): the node whose ``partition-id`` is K
    trains fedloom client K."""
    source = ConfigSource.of(config, data, model)
    app = ClientApp()

    @app.train()
    def _train(message: Message, context: Context) -> Message:
        return train(source, message, context)

    @app.query()
    def _query(message: Message, context: Context) -> Message:
        return query(message, context)

    return app
