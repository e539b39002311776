"""What travels between the ServerApp and a ClientApp in one fedloom round, as Flower
``RecordDict`` content (records.py encodes the trees).

Server -> client (message type ``train``)::

    message.<name>     ArrayRecord per tree of algorithm.server_message (params, buffers,
                       SCAFFOLD's control, FedProx's scheduled mu ...)
    state.<name>       the client's persistent state, only when the node does not hold it yet
                       (the first round it takes part in, or after the server resumed)
    fedloom.task       ConfigRecord: client, round, steps (the plan's length: the server
                       decides stragglers), full (steps asked for), state: none | sent | node

Client -> server (the reply)::

    upload.<name>      ArrayRecord per tree of the client's upload (what communication counts)
    state.<name>       the client's new persistent state (kept on the node; reported so that the
                       server can checkpoint it and evaluate personalized models)
    fedloom.result     ConfigRecord: client, round, weight, loss
    fedloom.info       MetricRecord: ClientResult.info (metrics that do not travel in fedloom's
                       accounting)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flwr.app import ConfigRecord, MetricRecord, RecordDict

from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.flower.records import get_trees, put_trees

MESSAGE, STATE, UPLOAD = "message", "state", "upload"
TASK, RESULT, INFO = "fedloom.task", "fedloom.result", "fedloom.info"
NODE = "fedloom.node"
"""The query reply's ConfigRecord: which fedloom client (``partition-id``) a node holds."""
PARTITION_ID = "partition-id"
"""The node-config key naming a node's client (Flower's simulation sets it; a SuperNode gets
it from ``--node-config "partition-id=K"``)."""

StateMode = Literal["none", "sent", "node"]


def message_content(message: Message) -> RecordDict:
    """The round's server message, encoded once and shared by every client's content."""
    content = RecordDict()
    put_trees(content, MESSAGE, message)
    return content


def train_content(
    shared: RecordDict, task: ClientTask, state: State | None, mode: StateMode
) -> RecordDict:
    """One client's work order: the round's message, its task and, with ``mode`` ``sent``,
    its state."""
    content = RecordDict(dict(shared))
    content[TASK] = ConfigRecord(
        {
            "client": task.client_id,
            "round": task.round,
            "steps": len(task.plan),
            "full": task.full if task.full is not None else -1,
            "state": mode,
        }
    )
    if mode == "sent":
        assert state is not None
        put_trees(content, STATE, state)
    return content


@dataclass
class TrainOrder:
    """A decoded work order (the client rebuilds the ClientTask from its own data)."""

    client: int
    round: int
    steps: int
    full: int | None
    message: Message
    mode: StateMode
    state: State | None


def read_train(content: RecordDict) -> TrainOrder:
    task = content.config_records[TASK]
    full = int(task["full"])  # type: ignore[arg-type]
    message = get_trees(content, MESSAGE)
    assert message is not None, "a train message without the server's message"
    return TrainOrder(
        client=int(task["client"]),  # type: ignore[arg-type]
        round=int(task["round"]),  # type: ignore[arg-type]
        steps=int(task["steps"]),  # type: ignore[arg-type]
        full=None if full < 0 else full,
        message=message,
        mode=str(task["state"]),  # type: ignore[arg-type]
        state=get_trees(content, STATE),
    )


def reply_content(result: ClientResult) -> RecordDict:
    content = RecordDict()
    put_trees(content, UPLOAD, result.upload)
    if result.state is not None:
        put_trees(content, STATE, result.state)
    content[RESULT] = ConfigRecord(
        {
            "client": result.client_id,
            "round": result.round,
            "weight": float(result.weight),
            "loss": float(result.loss),
        }
    )
    content[INFO] = MetricRecord({k: float(v) for k, v in result.info.items()})
    return content


def read_reply(content: RecordDict) -> ClientResult:
    meta = content.config_records[RESULT]
    upload = get_trees(content, UPLOAD)
    assert upload is not None, "a reply without an upload"
    return ClientResult(
        upload=upload,
        weight=float(meta["weight"]),  # type: ignore[arg-type]
        loss=float(meta["loss"]),  # type: ignore[arg-type]
        state=get_trees(content, STATE),
        info={k: float(v) for k, v in content.metric_records[INFO].items()},  # type: ignore[arg-type]
        client_id=int(meta["client"]),  # type: ignore[arg-type]
        round=int(meta["round"]),  # type: ignore[arg-type]
    )
