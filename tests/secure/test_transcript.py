"""The transcript both protocol families record into: party names, selection with ``*``
prefixes, bytes up and down (client <-> server only), bytes by stage, kept messages."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import pytest

from fedloom.secure.transcript import CLIENTS, SERVER, Transcript, client_id, client_party


@dataclass(frozen=True)
class Note:
    kind: ClassVar[str] = "note"
    text: str


@dataclass(frozen=True)
class Sealed:
    kind: ClassVar[str] = "sealed"
    items: tuple[object, ...]

    @property
    def payload(self) -> tuple[object, ...]:
        return self.items


def filled(keep_messages: bool) -> Transcript:
    """Round 0: server -> 2 clients (10 B each), clients -> server (100, 200 B), server <->
    another party (50, 7 B); round 1: client 1 -> server (30 B)."""
    t = Transcript(keep_messages)
    for u in (1, 2):
        t.record(
            Note("hi"), round=0, stage="hello", sender=SERVER, receiver=client_party(u), nbytes=10
        )
    for u, size in ((1, 100), (2, 200)):
        message = Sealed((b"x", u))
        t.record(message, round=0, stage="up", sender=client_party(u), receiver=SERVER, nbytes=size)
    t.record(Note("?"), round=0, stage="ask", sender=SERVER, receiver="authority", nbytes=50)
    t.record(Note("!"), round=0, stage="ask", sender="authority", receiver=SERVER, nbytes=7)
    t.record(Note("late"), round=1, stage="up", sender=client_party(1), receiver=SERVER, nbytes=30)
    return t


def test_parties() -> None:
    assert client_party(3) == "client:3" and client_id("client:3") == 3
    with pytest.raises(ValueError, match="not a client"):
        client_id(SERVER)


def test_select_and_bytes() -> None:
    t = filled(keep_messages=True)
    assert len(t.select(sender=CLIENTS)) == 3
    assert [d.nbytes for d in t.select(round=0, sender=CLIENTS)] == [100, 200]
    assert [d.receiver for d in t.select(sender=SERVER)] == ["client:1", "client:2", "authority"]
    assert t.select(receiver="client:2", kind="note")[0].message == Note("hi")
    assert t.nbytes(stage="ask") == 57
    assert t.nbytes(sender="client:1") == 130
    assert (t.bytes_up(), t.bytes_up(round=0), t.bytes_up(round=1)) == (330, 300, 30)
    assert (t.bytes_down(), t.bytes_down(round=1)) == (20, 0)
    assert t.bytes_by_stage() == {"hello": (0, 20), "up": (330, 0), "ask": (0, 0)}
    assert t.bytes_by_stage(round=1) == {"up": (30, 0)}
    assert {d.payload_types for d in t.select(kind="sealed")} == {frozenset({"bytes", "int"})}
    assert t.select(kind="note")[0].payload_types == frozenset()


def test_metadata_only() -> None:
    kept, light = filled(keep_messages=True), filled(keep_messages=False)
    assert kept.deliveries == light.deliveries  # the message is not part of the comparison
    assert all(d.message is None for d in light.deliveries)
    assert light.select(kind="sealed")[0].payload_types == {"bytes", "int"}
