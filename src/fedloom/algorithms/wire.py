"""What crosses the network in a round, as the engine counts and monitors it: the bytes the
clients download of the server's message (engine/pipeline.py; uploads are counted by the
mechanisms that send them) and what a client's upload moved, for the update norms and cosine
similarities of the monitoring (docs/monitoring.md). An algorithm supplies a :class:`Wire`
subclass when its message or upload is not the default's: the message sent whole to every
client, an upload holding ``params``, a ``delta`` or a ``grad``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fedloom.core.protocol import ClientResult, Message
from fedloom.core.pytree import Tree, num_bytes

if TYPE_CHECKING:
    from fedloom.algorithms.base import Algorithm


class Wire:
    """The default wire of ``algorithm`` (see the module doc)."""

    def __init__(self, algorithm: Algorithm) -> None:
        self.algorithm = algorithm

    def download_bytes(self, message: Message, clients: Sequence[int]) -> int:
        """Bytes ``clients`` download of ``message`` together (default: each all of it; FPFC
        sends each client only its own row of a per-client table). Once per round, not per
        client: 1,000 clients a round (W3)."""
        return len(clients) * sum(num_bytes(tree) for tree in message.values())

    def delta(self, message: Message, result: ClientResult) -> Tree | None:
        """What a client's round moved: an uploaded ``delta``, minus an uploaded gradient, or
        the uploaded ``params`` minus the broadcast ones on the keys both have; None when the
        upload holds no model-shaped update (FedProto's prototypes)."""
        upload = result.upload
        if "delta" in upload:
            return upload["delta"]
        if "grad" in upload:
            return {k: -g for k, g in upload["grad"].items()}
        if "params" in upload and "params" in message:
            sent = message["params"]
            common = [k for k in upload["params"] if k in sent]
            if common:
                return {k: upload["params"][k] - sent[k] for k in common}
        return None
