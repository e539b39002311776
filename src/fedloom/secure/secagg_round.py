"""One simulated round of SecAgg / SecAgg+: client and server role objects exchanging
messages through a recorded channel, with clients vanishing at their drop stage.

Drop stages (``base.DropStage``) map onto the rounds of Bonawitz et al. (CCS'17, Figure 4):
``keys``: advertised its keys, then gone (in U1, not U2); ``shares``: shared its keys, then
gone (in U2, not U3: its s_v^sk is rebuilt to strip its pairwise masks); ``unmask``: sent y_u,
then gone (in U3, not U5: its input is summed, its b_u rebuilt from others' shares).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from fedloom.secure.base import DROP_STAGES, DropStage
from fedloom.secure.secagg_client import SecAggClient
from fedloom.secure.secagg_graph import Graph
from fedloom.secure.secagg_messages import (
    AdvertiseKeys,
    ForwardedShares,
    KeyList,
    MaskedInput,
    Message,
    ShareKeys,
    UnmaskRequest,
    UnmaskResponse,
)
from fedloom.secure.secagg_server import SecAggServer
from fedloom.secure.transcript import SERVER, Transcript, client_party

ClientMessage = AdvertiseKeys | ShareKeys | MaskedInput | UnmaskResponse
PHASES = ("advertise_keys", "share_keys", "masked_input", "unmasking")
M = TypeVar("M", bound=Mapping[int, Message])


@dataclass
class MaskedSum:
    """What one round's unmasking yields: z = sum of the included clients' uint32 inputs
    (mod 2^32), the included clients (U3) ascending, the transcript, seconds by phase."""

    total: np.ndarray
    included: list[int]
    transcript: Transcript
    seconds: dict[str, float] = field(default_factory=dict)


class SecAggRound:
    """Clients and server of one round. ``inputs``: client -> its 1-D uint32 input (needed
    for every client that reaches MaskedInput); ``drops``: client -> stage at which it
    vanishes; ``graph``: client -> neighbours over all the round's clients; ``threshold``: t.
    Run it with :meth:`run`, or phase by phase (tests use ``clients`` and ``server``);
    ``key_lists``, ``forwarded`` and ``requests`` hold what the server last sent each client.
    ``transcript``: where messages are recorded (by default a fresh one that keeps them)."""

    def __init__(
        self,
        round: int,
        inputs: Mapping[int, np.ndarray],
        drops: Mapping[int, DropStage],
        graph: Graph,
        threshold: int,
        key_seed: int | None = None,
        transcript: Transcript | None = None,
    ) -> None:
        self.round = round
        self.participants = sorted(graph)
        _check_inputs(inputs, drops, self.participants)
        self.inputs = inputs
        self.drops = drops
        self.transcript = transcript if transcript is not None else Transcript(keep_messages=True)
        start = time.perf_counter()
        self.clients = {  # each generates its key pairs: part of AdvertiseKeys
            u: SecAggClient(u, round, graph[u], threshold, key_seed) for u in self.participants
        }
        self.server = SecAggServer(round, graph, threshold)
        self.seconds = dict.fromkeys(PHASES, 0.0)
        self.seconds[PHASES[0]] = time.perf_counter() - start
        self.key_lists: dict[int, KeyList] = {}
        self.forwarded: dict[int, ForwardedShares] = {}
        self.requests: dict[int, UnmaskRequest] = {}

    def _alive(self, after: DropStage | None) -> list[int]:
        """Clients still present once the clients dropping at ``after`` (and before) left."""
        gone = set(DROP_STAGES[: DROP_STAGES.index(after) + 1]) if after else set()
        return [u for u in self.participants if self.drops.get(u) not in gone]

    def _up(self, stage: str, msg: ClientMessage, receive: Callable[[Any], None]) -> None:
        self._record(stage, client_party(msg.sender), SERVER, msg)
        receive(msg)

    def _down(self, stage: str, messages: M) -> M:
        """Deliver the server's ``messages`` (client -> its message) and return them."""
        for u, msg in messages.items():
            self._record(stage, SERVER, client_party(u), msg)
        return messages

    def _record(self, stage: str, sender: str, receiver: str, msg: Message) -> None:
        self.transcript.record(
            msg, round=self.round, stage=stage, sender=sender, receiver=receiver, nbytes=msg.nbytes
        )

    @contextmanager
    def _timed(self, phase: str) -> Iterator[None]:
        """Add the seconds the block takes to ``phase``'s."""
        start = time.perf_counter()
        yield
        self.seconds[phase] += time.perf_counter() - start

    def advertise_keys(self) -> None:
        """Round 0: every client advertises; the server answers with the key lists."""
        with self._timed(PHASES[0]):
            for u in self._alive(None):
                self._up(PHASES[0], self.clients[u].advertise(), self.server.receive_keys)
            self.key_lists = self._down(PHASES[0], self.server.close_keys())

    def share_keys(self) -> None:
        """Round 1: clients still present share their keys; the server forwards the shares."""
        with self._timed(PHASES[1]):
            for u in self._alive("keys"):
                msg = self.clients[u].share_keys(self.key_lists[u])
                self._up(PHASES[1], msg, self.server.receive_shares)
            self.forwarded = self._down(PHASES[1], self.server.close_shares())

    def masked_input(self) -> None:
        """Round 2: clients still present send y_u; the server closes U3 and asks for shares."""
        with self._timed(PHASES[2]):
            for u in self._alive("shares"):
                msg = self.clients[u].masked_input(self.forwarded[u], self.inputs[u])
                self._up(PHASES[2], msg, self.server.receive_masked_input)
            self.requests = self._down(PHASES[2], self.server.close_masked_input())

    def unmasking(self) -> np.ndarray:
        """Round 3: clients still present answer; the server rebuilds secrets and unmasks."""
        with self._timed(PHASES[3]):
            for u in self._alive("unmask"):
                msg = self.clients[u].unmask(self.requests[u])
                self._up(PHASES[3], msg, self.server.receive_unmask)
            return self.server.close_unmask()

    def run(self) -> MaskedSum:
        """All four rounds; raises ``SecureAggregationAbort`` below the threshold."""
        self.advertise_keys()
        self.share_keys()
        self.masked_input()
        total = self.unmasking()
        return MaskedSum(total, sorted(self.server.u3), self.transcript, dict(self.seconds))


def _check_inputs(
    inputs: Mapping[int, np.ndarray], drops: Mapping[int, DropStage], participants: list[int]
) -> None:
    for u, stage in drops.items():
        if stage not in DROP_STAGES:
            raise ValueError(f"client {u}: unknown drop stage {stage!r}; valid: {DROP_STAGES}")
    senders = [u for u in participants if drops.get(u) not in ("keys", "shares")]
    missing = [u for u in senders if u not in inputs]
    if missing:
        raise ValueError(f"clients {missing} reach MaskedInput but have no input vector")
    shapes = {np.shape(inputs[u]) for u in senders}
    if len(shapes) > 1:
        raise ValueError(f"input vectors differ in shape: {sorted(shapes)}")
