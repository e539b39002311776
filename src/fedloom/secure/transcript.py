"""The transcript of a secure-aggregation protocol: every message delivered, with who sent what
kind of message to whom in which round and stage, its size on the wire and, optionally, the
message itself; and queries over it. SecAgg/SecAgg+ and the homomorphic-encryption backends
(Paillier, CKKS) record through it, so tests can check who saw what.

Parties are role names: :data:`SERVER`, ``client_party(u)`` (``"client:u"``) and any other role a
protocol has (the HE key authority is ``"key_authority"``). A party pattern in a query is a name
or a prefix ending in ``*``: :data:`CLIENTS` (``"client:*"``) matches every client. "Up" is
client -> server traffic, "down" server -> client; messages between other parties (the server
and the key authority) count in neither.

A message needs a ``kind`` (a short name such as ``"masked_input"``); if it has a ``payload``
(a tuple of items), the type names of those items are recorded too, kept or not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SERVER = "server"
CLIENTS = "client:*"
"""Party pattern matching every client."""
_CLIENT = "client:"


def client_party(client: int) -> str:
    """The party name of client ``client`` (``"client:3"``)."""
    return f"{_CLIENT}{int(client)}"


def client_id(party: str) -> int:
    """The client id in a client's party name (``"client:3"`` -> 3)."""
    if not party.startswith(_CLIENT):
        raise ValueError(f"party {party!r} is not a client")
    return int(party.removeprefix(_CLIENT))


@dataclass(frozen=True)
class Delivery:
    """One message delivered: its round and stage, sender and receiver (party names), kind,
    size in bytes, the type names of its payload items, and the message (None if not kept)."""

    round: int
    stage: str
    sender: str
    receiver: str
    kind: str
    nbytes: int
    payload_types: frozenset[str] = frozenset()
    message: Any = field(default=None, repr=False, compare=False)


class Transcript:
    """Every message of a protocol, in delivery order. ``keep_messages`` also keeps the message
    objects (tests; a round's masked inputs or ciphertexts can be gigabytes), otherwise only
    the metadata, enough to count bytes."""

    def __init__(self, keep_messages: bool = False) -> None:
        self.keep_messages = keep_messages
        self.deliveries: list[Delivery] = []

    def record(
        self, message: Any, *, round: int, stage: str, sender: str, receiver: str, nbytes: int
    ) -> None:
        """Record ``message`` (``nbytes`` on the wire) from ``sender`` to ``receiver``."""
        payload = getattr(message, "payload", ())
        self.deliveries.append(
            Delivery(
                round=round,
                stage=stage,
                sender=sender,
                receiver=receiver,
                kind=message.kind,
                nbytes=int(nbytes),
                payload_types=frozenset(type(item).__name__ for item in payload),
                message=message if self.keep_messages else None,
            )
        )

    def select(
        self,
        *,
        round: int | None = None,
        stage: str | None = None,
        sender: str | None = None,
        receiver: str | None = None,
        kind: str | None = None,
    ) -> list[Delivery]:
        """Deliveries matching every given filter (parties: a name or a ``*`` prefix)."""
        return [
            d
            for d in self.deliveries
            if (round is None or d.round == round)
            and (stage is None or d.stage == stage)
            and (kind is None or d.kind == kind)
            and _matches(d.sender, sender)
            and _matches(d.receiver, receiver)
        ]

    def nbytes(self, **selection: Any) -> int:
        """Bytes of the deliveries :meth:`select` returns for ``selection``."""
        return sum(d.nbytes for d in self.select(**selection))

    def bytes_up(self, round: int | None = None) -> int:
        """Bytes the clients sent to the server (in ``round``, or in all rounds)."""
        return self.nbytes(round=round, sender=CLIENTS, receiver=SERVER)

    def bytes_down(self, round: int | None = None) -> int:
        """Bytes the server sent to the clients (in ``round``, or in all rounds)."""
        return self.nbytes(round=round, sender=SERVER, receiver=CLIENTS)

    def bytes_by_stage(self, round: int | None = None) -> dict[str, tuple[int, int]]:
        """Stage -> (bytes up, bytes down), stages in the order they first occur."""
        totals: dict[str, tuple[int, int]] = {}
        for d in self.select(round=round):
            up, down = totals.get(d.stage, (0, 0))
            if _matches(d.sender, CLIENTS) and d.receiver == SERVER:
                up += d.nbytes
            elif d.sender == SERVER and _matches(d.receiver, CLIENTS):
                down += d.nbytes
            totals[d.stage] = (up, down)
        return totals


def _matches(party: str, pattern: str | None) -> bool:
    if pattern is None:
        return True
    if pattern.endswith("*"):
        return party.startswith(pattern[:-1])
    return party == pattern
