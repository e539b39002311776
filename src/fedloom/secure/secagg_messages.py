"""The messages of SecAgg's four rounds (Bonawitz et al. CCS'17, Figure 4); each has a ``kind``
and its size ``nbytes`` for the round's transcript (``transcript``).

Sizes count the payload as it would go on the wire: 4 bytes per client id, 32 per public key,
168 per encrypted share pair (12-byte nonce, 8 bytes of ids, two 66-byte Shamir shares,
16-byte tag), 66 per unmasking share, 4 per masked coordinate; no framing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

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
