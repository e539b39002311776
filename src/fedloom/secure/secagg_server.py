"""The server's side of SecAgg / SecAgg+ (Bonawitz et al. CCS'17, Figure 4, semi-honest
version; Bell et al. CCS'20 over a k-regular graph).

The server routes keys and encrypted shares, collects the masked inputs y_u, and after the
unmasking round rebuilds b_v for every v in U3 and s_v^sk for every v in U2 \\ U3 that a
survivor masked with, to compute z = sum_{u in U3} q_u (mod 2^32). It sees only public keys,
ciphertexts, masked inputs and the shares it asks for; below the threshold t at any step it
aborts instead of producing output.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey

from fedloom.secure import secagg_crypto as crypto
from fedloom.secure import shamir
from fedloom.secure.base import SecureAggregationAbort
from fedloom.secure.secagg_graph import Graph
from fedloom.secure.secagg_messages import (
    AdvertiseKeys,
    ForwardedShares,
    KeyList,
    MaskedInput,
    ShareKeys,
    UnmaskRequest,
    UnmaskResponse,
)

STAGES = ("AdvertiseKeys", "ShareKeys", "MaskedInput", "Unmasking", "done")


class MessageRejected(Exception):
    """The server refused a message (late, out of turn, from an unknown or duplicate sender);
    the round goes on without it. A y_u arriving after u was declared dropped is rejected:
    u's s_u^sk may already be public, only b_u would still hide q_u."""


class SecAggServer:
    """The server of one round over ``graph`` (client -> neighbours) with threshold t."""

    def __init__(self, round: int, graph: Graph, threshold: int) -> None:
        self.round = round
        self.graph = graph
        self.threshold = threshold
        self.stage = STAGES[0]
        self._keys: dict[int, tuple[bytes, bytes]] = {}
        self._shares: dict[int, dict[int, bytes]] = {}
        self._holders: dict[int, frozenset[int]] = {}
        self._inputs: dict[int, np.ndarray] = {}
        self._responses: dict[int, UnmaskResponse] = {}
        self._requests: dict[int, UnmaskRequest] = {}
        self.u1: frozenset[int] = frozenset()
        self.u2: frozenset[int] = frozenset()
        self.u3: frozenset[int] = frozenset()
        self.u5: frozenset[int] = frozenset()

    def _expect(self, stage: str, sender: int, allowed: Iterable[int], seen: Iterable[int]) -> None:
        if self.stage != stage:
            raise MessageRejected(
                f"round {self.round}: a {stage} message from client {sender} arrived during "
                f"{self.stage}; rejected"
            )
        if sender not in allowed:
            raise MessageRejected(f"round {self.round}: client {sender} may not send {stage}")
        if sender in seen:
            raise MessageRejected(f"round {self.round}: duplicate {stage} from client {sender}")

    def _check(self, stage: str, survived: int, what: str) -> None:
        if survived < self.threshold:
            self.stage = "aborted"
            raise SecureAggregationAbort(
                f"SecAgg round {self.round} aborted at {stage}: {survived} {what}, "
                f"threshold is {self.threshold}; no output"
            )

    # Round 0: AdvertiseKeys
    def receive_keys(self, msg: AdvertiseKeys) -> None:
        self._expect("AdvertiseKeys", msg.sender, self.graph, self._keys)
        self._keys[msg.sender] = (msg.c_public, msg.s_public)

    def close_keys(self) -> dict[int, KeyList]:
        """U1 = the clients that advertised; needs |U1| >= t and, per client, t holders
        (itself and its neighbours in U1). Each client gets its neighbours' keys."""
        self.u1 = frozenset(self._keys)
        self._check("AdvertiseKeys", len(self.u1), "clients advertised keys")
        for u in sorted(self.u1):
            holders = len(self.graph[u] & self.u1) + 1
            self._check(
                "AdvertiseKeys", holders, f"clients of client {u}'s neighbourhood advertised keys"
            )
        self.stage = "ShareKeys"
        return {
            u: KeyList({v: self._keys[v] for v in sorted(self.graph[u] & self.u1)})
            for u in sorted(self.u1)
        }

    # Round 1: ShareKeys
    def receive_shares(self, msg: ShareKeys) -> None:
        self._expect("ShareKeys", msg.sender, self.u1, self._shares)
        if not set(msg.ciphertexts) <= self.graph[msg.sender] & self.u1:
            raise MessageRejected(f"client {msg.sender} sent shares to non-neighbours; rejected")
        self._shares[msg.sender] = dict(msg.ciphertexts)

    def close_shares(self) -> dict[int, ForwardedShares]:
        """U2 = the clients that shared; needs |U2| >= t. Forwards to each v in U2 the
        ciphertexts addressed to it; v then holds a share of each sender's secrets."""
        self.u2 = frozenset(self._shares)
        self._check("ShareKeys", len(self.u2), "clients shared their keys")
        for u in self.u2:
            self._holders[u] = frozenset(v for v in self._shares[u] if v in self.u2) | {u}
        self.stage = "MaskedInput"
        return {
            v: ForwardedShares(
                {u: self._shares[u][v] for u in sorted(self.u2) if v in self._shares[u]}
            )
            for v in sorted(self.u2)
        }

    # Round 2: MaskedInput
    def receive_masked_input(self, msg: MaskedInput) -> None:
        self._expect("MaskedInput", msg.sender, self.u2, self._inputs)
        first = next(iter(self._inputs.values()), None)
        if msg.y.dtype != np.uint32 or msg.y.ndim != 1:
            raise MessageRejected(f"client {msg.sender}'s masked input is not a uint32 vector")
        if first is not None and msg.y.shape != first.shape:
            raise MessageRejected(
                f"client {msg.sender}'s masked input has shape {msg.y.shape}, others {first.shape}"
            )
        self._inputs[msg.sender] = msg.y

    def close_masked_input(self) -> dict[int, UnmaskRequest]:
        """U3 = the clients whose y_u arrived; needs |U3| >= t. Later y_u are rejected. Asks
        each u in U3 for the b_v shares of survivors and the s_v^sk shares of dropped clients
        a survivor masked with, among the v whose shares u holds."""
        self.u3 = frozenset(self._inputs)
        self._check("MaskedInput", len(self.u3), "clients sent masked inputs")
        self.stage = "Unmasking"
        needed = self._dropped_to_unmask()
        self._requests = {
            u: UnmaskRequest(
                survivors=tuple(v for v in sorted(self.u3) if u in self._holders[v]),
                dropped=tuple(v for v in needed if u in self._holders[v]),
            )
            for u in sorted(self.u3)
        }
        return dict(self._requests)

    def _dropped_to_unmask(self) -> list[int]:
        """v in U2 \\ U3 with a neighbour in U3 (whose y_u carries p_{u,v})."""
        return [v for v in sorted(self.u2 - self.u3) if self.graph[v] & self.u3]

    # Round 3: Unmasking
    def receive_unmask(self, msg: UnmaskResponse) -> None:
        self._expect("Unmasking", msg.sender, self.u3, self._responses)
        request = self._requests[msg.sender]
        if not (
            set(msg.b_shares) <= set(request.survivors)
            and set(msg.sk_shares) <= set(request.dropped)
        ):
            raise MessageRejected(f"client {msg.sender} sent shares the server did not ask for")
        self._responses[msg.sender] = msg

    def close_unmask(self) -> np.ndarray:
        """U5 = the responders; needs |U5| >= t and t responding holders for every secret to
        rebuild. z = sum_{U3} y_u - sum_{U3} PRG(b_u) - sum_{u in U3, v in U2\\U3} p_{u,v}."""
        self.u5 = frozenset(self._responses)
        self._check("Unmasking", len(self.u5), "clients answered the unmasking request")
        b_seeds = {v: self._rebuild(v, "b_shares") for v in sorted(self.u3)}
        mask_keys: dict[int, X25519PrivateKey] = {}
        for v in self._dropped_to_unmask():
            key = crypto.private_key_from_bytes(self._rebuild(v, "sk_shares"))
            if crypto.public_bytes(key) != self._keys[v][1]:
                self.stage = "aborted"
                raise SecureAggregationAbort(
                    f"SecAgg round {self.round} aborted at Unmasking: the rebuilt s_v^sk of "
                    f"client {v} does not match its public key; no output"
                )
            mask_keys[v] = key
        self.stage = "done"
        return self._unmask(b_seeds, mask_keys)

    def _rebuild(self, v: int, kind: str) -> bytes:
        """v's secret from the first t responders' shares (kind: b_shares or sk_shares)."""
        shares = [
            shamir.share_from_bytes(shamir.x_of(u), getattr(self._responses[u], kind)[v])
            for u in sorted(self.u5)
            if v in getattr(self._responses[u], kind)
        ]
        secret = "b_v" if kind == "b_shares" else "s_v^sk"
        self._check("Unmasking", len(shares), f"holders answered with shares of {secret} of {v}")
        try:
            return shamir.combine(shares[: self.threshold])
        except ValueError as err:
            self.stage = "aborted"
            raise SecureAggregationAbort(
                f"SecAgg round {self.round} aborted at Unmasking: {secret} of client {v} "
                f"could not be rebuilt ({err}); no output"
            ) from err

    def _unmask(
        self, b_seeds: dict[int, bytes], mask_keys: dict[int, X25519PrivateKey]
    ) -> np.ndarray:
        ys = [self._inputs[u] for u in sorted(self.u3)]
        length = ys[0].size
        z = np.zeros(length, dtype=np.uint32)
        for y in ys:
            z += y
        for v, seed in b_seeds.items():
            z -= crypto.self_mask(seed, self.round, v, length)
        for v, key in mask_keys.items():
            for u in sorted(self.graph[v] & self.u3):
                secret = crypto.agree(key, self._keys[u][1])
                mask = crypto.pair_mask(secret, self.round, u, v, length)
                if u < v:  # y_u carried p_{u,v} = +mask
                    z -= mask
                else:  # y_u carried p_{u,v} = -mask
                    z += mask
        return z
