"""A client's side of SecAgg / SecAgg+ (Bonawitz et al. CCS'17, Figure 4, semi-honest
version; Bell et al. CCS'20 restrict every step to the client's neighbours in a graph).

The client's secrets (c_u^sk, s_u^sk, b_u and its input q_u) never leave this object except
as the protocol says: Shamir shares encrypted for a neighbour, the masked input y_u, and in
the unmasking round either the b_v share or the s_v^sk share of each v, never both.
"""

from __future__ import annotations

import struct

import numpy as np

from fedloom.secure import secagg_crypto as crypto
from fedloom.secure import secagg_messages as msg
from fedloom.secure import shamir
from fedloom.secure.base import SecureAggregationAbort

_IDS = struct.Struct("<II")
_S, _B = "s_sk", "b"  # which of v's two shares a client revealed


class UnmaskRefused(SecureAggregationAbort):
    """A client refused an unmasking request that would reveal too much (both b_v and
    s_v^sk of one v, or shares it never held): the round aborts."""


def share_aad(round: int, sender: int, receiver: int) -> bytes:
    """Associated data of an encrypted share: binds it to its round, sender and receiver."""
    return struct.pack("<qqq", round, sender, receiver)


class SecAggClient:
    """Client u of one round. ``neighbours``: the clients it exchanges keys, shares and masks
    with (all others in SecAgg); ``threshold``: t of its t-of-(holders) Shamir sharings.
    ``key_seed`` derives its keys and b_u deterministically: tests only."""

    def __init__(
        self,
        client: int,
        round: int,
        neighbours: frozenset[int],
        threshold: int,
        key_seed: int | None = None,
    ) -> None:
        self.id = client
        self.round = round
        self.neighbours = neighbours
        self.threshold = threshold
        self._key_seed = key_seed
        self._c_key = crypto.private_key(key_seed, round, client, "channel")
        self._s_key = crypto.private_key(key_seed, round, client, "mask")
        self._peers: dict[int, tuple[bytes, bytes]] = {}
        self._channel_keys: dict[int, bytes] = {}
        self._own_shares: tuple[shamir.Share, shamir.Share] | None = None
        self._b: bytes | None = None
        self._received: dict[int, bytes] = {}
        self._revealed: dict[int, str] = {}

    def _abort(self, stage: str, reason: str) -> SecureAggregationAbort:
        return SecureAggregationAbort(
            f"SecAgg round {self.round} aborted at {stage}: client {self.id} {reason}; no output"
        )

    # Round 0: AdvertiseKeys
    def advertise(self) -> msg.AdvertiseKeys:
        """Send c_u^pk and s_u^pk."""
        return msg.AdvertiseKeys(
            self.id, crypto.public_bytes(self._c_key), crypto.public_bytes(self._s_key)
        )

    # Round 1: ShareKeys
    def share_keys(self, key_list: msg.KeyList) -> msg.ShareKeys:
        """Draw b_u; t-of-m Shamir-share s_u^sk and b_u among the m holders (u and its
        neighbours in U1); encrypt v's pair of shares under KA(c_u^sk, c_v^pk)."""
        unknown = set(key_list.keys) - self.neighbours
        if unknown:
            raise self._abort("ShareKeys", f"got keys of non-neighbours {sorted(unknown)}")
        keys = [pk for pair in key_list.keys.values() for pk in pair]
        own = (crypto.public_bytes(self._c_key), crypto.public_bytes(self._s_key))
        if len(set(keys) | set(own)) != len(keys) + 2:
            raise self._abort("ShareKeys", "got duplicated public keys")
        holders = sorted({*key_list.keys, self.id})
        if len(holders) < self.threshold:
            raise self._abort(
                "ShareKeys",
                f"has {len(holders)} share holders (itself and neighbours that advertised "
                f"keys), threshold is {self.threshold}",
            )
        self._peers = dict(key_list.keys)
        self._b = crypto.random_seed(self._key_seed, self.round, self.id, "self-mask")
        xs = [shamir.x_of(v) for v in holders]
        s_shares = shamir.split(crypto.private_bytes(self._s_key), xs, self.threshold)
        b_shares = shamir.split(self._b, xs, self.threshold)
        ciphertexts = {}
        for v, s_share, b_share in zip(holders, s_shares, b_shares, strict=True):
            if v == self.id:
                self._own_shares = (s_share, b_share)
                continue
            plaintext = _IDS.pack(self.id, v)
            plaintext += shamir.share_to_bytes(s_share) + shamir.share_to_bytes(b_share)
            ciphertexts[v] = crypto.seal(
                self._channel_key(v), plaintext, share_aad(self.round, self.id, v)
            )
        return msg.ShareKeys(self.id, ciphertexts)

    def _channel_key(self, v: int) -> bytes:
        if v not in self._channel_keys:
            secret = crypto.agree(self._c_key, self._peers[v][0])
            self._channel_keys[v] = crypto.derive(secret, self.round, crypto.CHANNEL, self.id, v)
        return self._channel_keys[v]

    # Round 2: MaskedInput
    def masked_input(self, forwarded: msg.ForwardedShares, q: np.ndarray) -> msg.MaskedInput:
        """y_u = q_u + PRG(b_u) + sum over v in U2 (neighbours that shared) of p_{u,v},
        p_{u,v} = +PRG(s_{u,v}) if u < v else -PRG(s_{u,v}), all mod 2^32."""
        if self._b is None:
            raise self._abort("MaskedInput", "has not shared its keys")
        senders = set(forwarded.ciphertexts)
        if not senders <= set(self._peers):
            raise self._abort("MaskedInput", f"got shares from non-neighbours {senders}")
        if len(senders) + 1 < self.threshold:
            raise self._abort(
                "MaskedInput",
                f"sees {len(senders) + 1} clients in U2 (itself and neighbours that shared), "
                f"threshold is {self.threshold}",
            )
        self._received = dict(forwarded.ciphertexts)
        q = np.asarray(q)
        if q.dtype != np.uint32 or q.ndim != 1:
            raise ValueError(f"a masked input is a 1-D uint32 vector, got {q.dtype} {q.shape}")
        length = q.size
        y = q.copy()
        y += crypto.self_mask(self._b, self.round, self.id, length)
        for v in sorted(senders):
            secret = crypto.agree(self._s_key, self._peers[v][1])
            mask = crypto.pair_mask(secret, self.round, self.id, v, length)
            if self.id < v:
                y += mask
            else:
                y -= mask
        return msg.MaskedInput(self.id, y)

    # Round 3: Unmasking
    def unmask(self, request: msg.UnmaskRequest) -> msg.UnmaskResponse:
        """Reveal v's b_v share for each surviving v and v's s_v^sk share for each dropped v,
        after checking that no v is asked for both (in this request or with an earlier one)."""
        survivors, dropped = set(request.survivors), set(request.dropped)
        both = survivors & dropped
        both |= {v for v in survivors if self._revealed.get(v) == _S}
        both |= {v for v in dropped if self._revealed.get(v) == _B}
        if self.id in dropped:
            both.add(self.id)  # it sent y_u: its s_u^sk must stay secret
        if both:
            raise UnmaskRefused(
                f"SecAgg round {self.round}: client {self.id} refuses to reveal both the b_v and "
                f"the s_v^sk share of v in {sorted(both)}; aborted, no output"
            )
        held = set(self._received) | {self.id}
        if not (survivors | dropped) <= held:
            raise UnmaskRefused(
                f"SecAgg round {self.round}: client {self.id} holds no shares of "
                f"{sorted((survivors | dropped) - held)}; aborted, no output"
            )
        if len(survivors) < self.threshold:
            raise self._abort(
                "Unmasking",
                f"sees {len(survivors)} survivors among the clients whose shares it holds, "
                f"threshold is {self.threshold}",
            )
        b_shares, sk_shares = {}, {}
        for v in sorted(survivors | dropped):
            s_share, b_share = self._shares_of(v)
            if v in survivors:
                self._revealed[v] = _B
                b_shares[v] = b_share
            else:
                self._revealed[v] = _S
                sk_shares[v] = s_share
        return msg.UnmaskResponse(self.id, b_shares, sk_shares)

    def _shares_of(self, v: int) -> tuple[bytes, bytes]:
        """v's serialised (s_v^sk share, b_v share) held by this client."""
        if v == self.id:
            assert self._own_shares is not None
            s_share, b_share = self._own_shares
            return shamir.share_to_bytes(s_share), shamir.share_to_bytes(b_share)
        plaintext = crypto.open_sealed(
            self._channel_key(v), self._received[v], share_aad(self.round, v, self.id)
        )
        if _IDS.unpack_from(plaintext) != (v, self.id):
            raise self._abort("Unmasking", f"got a share from {v} addressed to someone else")
        start = _IDS.size
        middle = start + shamir.SHARE_BYTES
        return plaintext[start:middle], plaintext[middle : middle + shamir.SHARE_BYTES]
