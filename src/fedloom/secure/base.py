"""The contract every secure-summation protocol meets (SecAgg, SecAgg+, Paillier, CKKS), and
the client dropouts it must survive."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from fedloom.errors import FedloomInputError, RoundAborted

DropStage = Literal["keys", "shares", "unmask"]
"""When a sampled client vanishes in a round:

- ``keys``: after advertising its keys, before sharing them (SecAgg round 1);
- ``shares``: after sharing its keys, before sending its masked input (round 2);
- ``unmask``: after sending its masked input, before the unmasking round (round 3).

A client that vanishes at ``keys`` or ``shares`` contributes nothing; one that vanishes at
``unmask`` has sent its input, which is still summed. Protocols without these rounds (Paillier,
CKKS, plain) read ``keys``/``shares`` as "never uploaded" and ``unmask`` as "uploaded".
"""

DROP_STAGES: tuple[DropStage, ...] = ("keys", "shares", "unmask")


class SecureAggregationAbort(RoundAborted):
    """The round's protocol cannot finish (too few clients survive for the threshold): no
    output is produced for the round. Never a wrong sum."""


class SecureAggregationConfigError(FedloomInputError):
    """Protocol settings that cannot work (e.g. a quantization that overflows the modulus),
    detected before any client computes anything."""


@dataclass
class SecureSumResult:
    """What the server learns from one round of a protocol."""

    total: np.ndarray
    """float64 vector: the sum of the included clients' (clipped, decoded) vectors."""
    included: list[int]
    """The clients whose vectors are in ``total``, ascending."""
    bytes_up: int = 0
    """Bytes all clients sent to the server (or key authority) this round."""
    bytes_down: int = 0
    """Bytes the server sent to the clients this round."""
    seconds: dict[str, float] = field(default_factory=dict)
    """Time by phase, e.g. {"crypto": ..., "encode": ..., "total": ...}."""


class SecureSum(Protocol):
    """One round of secure summation over the clients in ``vectors``.

    ``vectors``: client id -> float vector (same length for all) of the clients that compute
    an input this round; ``drops``: client id -> the stage at which that client vanishes (a
    client may be in ``drops`` without being in ``vectors`` when it vanishes before
    uploading). Each vector's coordinates are clipped to the protocol's range before encoding.
    Raises ``SecureAggregationAbort`` when the round cannot finish.
    """

    def sum(
        self,
        round: int,
        vectors: Mapping[int, np.ndarray],
        drops: Mapping[int, DropStage],
    ) -> SecureSumResult: ...
