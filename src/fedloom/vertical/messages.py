"""Role objects and the messages between them (docs/vertical.md, Cross-cutting).

Every vertical protocol runs in-process as role objects (:class:`Party`) that hold only their
own data and exchange explicit :class:`Message` objects over one :class:`Channel`. The channel
records every delivery in a :class:`~fedloom.secure.transcript.Transcript` (party names such
as ``"guest"``, ``"host:1"``, ``"coordinator"``; the stage names the protocol step) with its
size on the wire, so that tests can prove who saw what and runs can report bytes per party.
The channel also keeps the seconds spent in cryptography (encryption, homomorphic arithmetic,
decryption, masking, secret-sharing arithmetic) apart from the rest.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedloom.secure.transcript import Delivery, Transcript

PREDICT = "predict"
"""Stage of the messages exchanged for cross-party prediction (not training)."""


def host_name(index: int) -> str:
    """The name of host (passive party) ``index`` (1, 2, ...: the parties' order)."""
    return f"host:{index}"


@dataclass(frozen=True)
class Message:
    """One message: its ``kind`` and its payload items (arrays, encrypted arrays, ints)."""

    kind: str
    payload: tuple[Any, ...] = ()

    def __getitem__(self, index: int) -> Any:
        return self.payload[index]


def payload_nbytes(item: Any) -> int:
    """Size of one payload item on the wire: an object's own ``nbytes`` (encrypted arrays:
    ciphertexts × ⌈bits(n²)/8⌉), a numeric array's buffer, Python ints by their bit length,
    floats as 8 bytes; containers add up their items."""
    if item is None:
        return 0
    if isinstance(item, np.ndarray) and item.dtype == object:
        return sum(payload_nbytes(v) for v in item.ravel())
    nbytes = getattr(item, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    if isinstance(item, bool):
        return 1
    if isinstance(item, int):
        return max(1, (abs(item).bit_length() + 8) // 8)
    if isinstance(item, float):
        return 8
    if isinstance(item, str | bytes):
        return len(item)
    if isinstance(item, dict):
        return sum(payload_nbytes(k) + payload_nbytes(v) for k, v in item.items())
    if isinstance(item, list | tuple):
        return sum(payload_nbytes(v) for v in item)
    return int(np.asarray(item).nbytes)


class Channel:
    """Delivers messages between parties, records them, and times the cryptography."""

    def __init__(self, keep_messages: bool = False) -> None:
        self.transcript = Transcript(keep_messages=keep_messages)
        self.round = 0
        self.crypto_seconds = 0.0

    def send(self, sender: str, receiver: str, kind: str, *payload: Any, stage: str) -> Message:
        """Record ``Message(kind, payload)`` from ``sender`` to ``receiver`` and return it (the
        caller hands it to the receiver's method: the only way data moves between roles)."""
        message = Message(kind, tuple(payload))
        self.transcript.record(
            message,
            round=self.round,
            stage=stage,
            sender=sender,
            receiver=receiver,
            nbytes=sum(payload_nbytes(item) for item in payload),
        )
        return message

    def state_dict(self) -> dict[str, Any]:
        """The delivery records (never the messages) and the cryptography seconds: what a
        checkpoint keeps of the channel (docs/vertical.md, Checkpoints and resume)."""
        return {
            "deliveries": [
                [d.round, d.stage, d.sender, d.receiver, d.kind, d.nbytes, sorted(d.payload_types)]
                for d in self.transcript.deliveries
            ],
            "crypto_seconds": self.crypto_seconds,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        """Put the saved deliveries before those of this session (a resumed session's own
        setup, such as its fresh public keys, stays counted after them)."""
        old = [
            Delivery(r, stage, s, to, kind, int(n), frozenset(types))
            for r, stage, s, to, kind, n, types in saved["deliveries"]
        ]
        self.transcript.deliveries[:0] = old
        self.crypto_seconds += float(saved["crypto_seconds"])

    @contextmanager
    def crypto(self) -> Iterator[None]:
        """Count the enclosed time as cryptography."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.crypto_seconds += time.perf_counter() - start

    def received(self, party: str, *, stage: str | None = None) -> list[Delivery]:
        """Every delivery to ``party`` (optionally of one stage)."""
        return self.transcript.select(receiver=party, stage=stage)

    def bytes_by_party(self, *, prediction: bool = False) -> dict[str, dict[str, int]]:
        """party -> {"sent": bytes, "received": bytes}, parties in order of first appearance:
        training messages, or (``prediction=True``) those of cross-party prediction."""
        out: dict[str, dict[str, int]] = {}
        for d in self.transcript.deliveries:
            if (d.stage == PREDICT) != prediction:
                continue
            out.setdefault(d.sender, {"sent": 0, "received": 0})["sent"] += d.nbytes
            out.setdefault(d.receiver, {"sent": 0, "received": 0})["received"] += d.nbytes
        return out


class Party:
    """A role: a name, the channel, and (in subclasses) only that party's own data."""

    def __init__(self, name: str, channel: Channel) -> None:
        self.name = name
        self.channel = channel

    def send(self, receiver: Party | str, kind: str, *payload: Any, stage: str) -> Message:
        to = receiver if isinstance(receiver, str) else receiver.name
        return self.channel.send(self.name, to, kind, *payload, stage=stage)
