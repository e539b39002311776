"""The messages of SecAgg's four rounds (Bonawitz et al. CCS'17, Figure 4) and a transcript
that records every delivery: who sent what kind of message to whom, and its size.

Sizes count the payload as it would go on the wire: 4 bytes per client id, 32 per public key,
168 per encrypted share pair (12-byte nonce, 8 bytes of ids, two 66-byte Shamir shares,
16-byte tag), 66 per unmasking share, 4 per masked coordinate; no framing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

SERVER = -1
"""The server's party id in transcripts (clients are >= 0)."""
ID_BYTES = 4
PUBLIC_KEY_BYTES = 32


@dataclass(frozen=True, eq=False)
class AdvertiseKeys:
    """Round 0, client -> server: u's public keys c_u^pk (channel) and s_u^pk (masks)."""

    kind: ClassVar[str] = "advertise_keys"
    sender: int
    c_public: bytes
    s_public: bytes

    @property
    def nbytes(self) -> int:
        return ID_BYTES + 2 * PUBLIC_KEY_BYTES


@dataclass(frozen=True, eq=False)
class KeyList:
    """Round 0, server -> client: the public keys (c_v^pk, s_v^pk) of the client's neighbours
    in U1 (every other client in SecAgg), by client id."""

    kind: ClassVar[str] = "key_list"
    keys: Mapping[int, tuple[bytes, bytes]]

    @property
    def nbytes(self) -> int:
        return len(self.keys) * (ID_BYTES + 2 * PUBLIC_KEY_BYTES)


@dataclass(frozen=True, eq=False)
class ShareKeys:
    """Round 1, client -> server: AE-encrypted shares of s_u^sk and b_u, by recipient v."""

    kind: ClassVar[str] = "share_keys"
    sender: int
    ciphertexts: Mapping[int, bytes]

    @property
    def nbytes(self) -> int:
        return ID_BYTES + sum(ID_BYTES + len(c) for c in self.ciphertexts.values())


@dataclass(frozen=True, eq=False)
class ForwardedShares:
    """Round 1, server -> client v: the ciphertexts addressed to v, by sender u. Their
    senders are v's view of U2 (its neighbours that shared their keys)."""

    kind: ClassVar[str] = "forwarded_shares"
    ciphertexts: Mapping[int, bytes]

    @property
    def nbytes(self) -> int:
        return sum(ID_BYTES + len(c) for c in self.ciphertexts.values())


@dataclass(frozen=True, eq=False)
class MaskedInput:
    """Round 2, client -> server: y_u = q_u + PRG(b_u) + sum_v p_{u,v} (mod 2^32)."""

    kind: ClassVar[str] = "masked_input"
    sender: int
    y: np.ndarray

    @property
    def nbytes(self) -> int:
        return ID_BYTES + int(self.y.nbytes)


@dataclass(frozen=True, eq=False)
class UnmaskRequest:
    """Round 3, server -> client: which of the clients whose shares it holds survived
    (``survivors`` in U3: reveal their b_v share) and which dropped (``dropped`` in U2 \\ U3:
    reveal their s_v^sk share)."""

    kind: ClassVar[str] = "unmask_request"
    survivors: tuple[int, ...]
    dropped: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return ID_BYTES * (len(self.survivors) + len(self.dropped))


@dataclass(frozen=True, eq=False)
class UnmaskResponse:
    """Round 3, client -> server: serialised Shamir shares of b_v (v survived) and of s_v^sk
    (v dropped), by v; never both for one v."""

    kind: ClassVar[str] = "unmask_response"
    sender: int
    b_shares: Mapping[int, bytes]
    sk_shares: Mapping[int, bytes]

    @property
    def nbytes(self) -> int:
        shares = list(self.b_shares.values()) + list(self.sk_shares.values())
        return ID_BYTES + sum(ID_BYTES + len(s) for s in shares)


Message = (
    AdvertiseKeys
    | KeyList
    | ShareKeys
    | ForwardedShares
    | MaskedInput
    | UnmaskRequest
    | UnmaskResponse
)


@dataclass(frozen=True)
class Delivery:
    """One message delivered: the round's stage, sender and receiver (``SERVER`` or a client
    id), the message kind and size, and the message itself (None when not kept)."""

    stage: str
    sender: int
    receiver: int
    kind: str
    nbytes: int
    message: Message | None = field(repr=False, compare=False)


class Transcript:
    """Every message of a round, in delivery order. ``keep_messages=False`` keeps only the
    metadata (kind and size), for long runs that only count bytes."""

    def __init__(self, keep_messages: bool = True) -> None:
        self.keep_messages = keep_messages
        self.deliveries: list[Delivery] = []

    def record(self, stage: str, sender: int, receiver: int, message: Message) -> None:
        kept = message if self.keep_messages else None
        self.deliveries.append(
            Delivery(stage, sender, receiver, message.kind, message.nbytes, kept)
        )

    def received_by(self, party: int) -> list[Delivery]:
        return [d for d in self.deliveries if d.receiver == party]

    def sent_by(self, party: int) -> list[Delivery]:
        return [d for d in self.deliveries if d.sender == party]

    @property
    def bytes_up(self) -> int:
        """Bytes the clients sent to the server."""
        return sum(d.nbytes for d in self.deliveries if d.receiver == SERVER)

    @property
    def bytes_down(self) -> int:
        """Bytes the server sent to the clients."""
        return sum(d.nbytes for d in self.deliveries if d.sender == SERVER)

    def bytes_by_stage(self) -> dict[str, tuple[int, int]]:
        """Stage -> (bytes up, bytes down)."""
        totals: dict[str, tuple[int, int]] = {}
        for d in self.deliveries:
            up, down = totals.get(d.stage, (0, 0))
            if d.receiver == SERVER:
                up += d.nbytes
            else:
                down += d.nbytes
            totals[d.stage] = (up, down)
        return totals
