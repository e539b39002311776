"""An in-process Flower grid for protocol tests: each node is a Context and the ClientApp is
called directly (no Ray, no network); Flower's real transports are exercised by
test_simulation.py and the deployment in docs/flower.md."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

NODE_IDS = 1000
"""Flower node ids of the nodes (partition K: node NODE_IDS + K), unlike the client ids."""


class InProcessGrid(Grid):
    """Nodes ``partitions`` (partition-id K -> node ``NODE_IDS + K``) running ``app``.
    ``fail(message, context)`` may return a reason to make a node answer with an error."""

    def __init__(
        self,
        app: ClientApp,
        partitions: Iterable[int],
        fail: Callable[[Message, Context], str | None] | None = None,
    ) -> None:
        self.app = app
        self.fail = fail
        # what Flower's runtimes set before a ServerApp runs (messages are stamped with it)
        TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 0
        self.contexts = {
            NODE_IDS + k: Context(
                run_id=1,
                node_id=NODE_IDS + k,
                node_config={"partition-id": k},
                state=RecordDict(),
                run_config={},
            )
            for k in partitions
        }
        self.sent: list[Message] = []

    def set_run(self, run: object) -> None:
        pass

    @property
    def run(self) -> object:  # type: ignore[override]
        return None

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):  # type: ignore[no-untyped-def]
        return Message(content, dst_node_id, message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> list[int]:
        return list(self.contexts)

    def push_messages(self, messages: Iterable[Message]) -> list[str]:
        raise NotImplementedError

    def pull_messages(self, message_ids: Iterable[str]) -> list[Message]:
        raise NotImplementedError

    def send_and_receive(
        self, messages: Iterable[Message], *, timeout: float | None = None
    ) -> list[Message]:
        replies = []
        for message in messages:
            self.sent.append(message)
            context = self.contexts[message.metadata.dst_node_id]
            reason = self.fail(message, context) if self.fail else None
            if reason is not None:
                replies.append(Message(Error(code=1, reason=reason), reply_to=message))
                continue
            try:
                replies.append(self.app(message, context))
            except Exception as err:  # what Flower's runtimes do with a ClientApp's exception
                replies.append(
                    Message(Error(code=2, reason=f"{type(err).__name__}: {err}"), reply_to=message)
                )
        return replies
