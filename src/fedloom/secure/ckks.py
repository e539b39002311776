"""CKKS-encrypted FedAvg with TenSEAL (docs/secure_aggregation.md, CKKS).

Same roles as the Paillier backend (``he_protocol``): the key authority alone holds the secret
context; clients and the server get the public context (``serialize(save_secret_key=False)``,
without relinearisation or Galois keys, which a sum does not need). Clients encrypt their
clipped vector in chunks of 4,096 slots (N = 8192, coefficient moduli [60, 40, 40, 60],
scale 2^40: about 128-bit security); the server adds the deserialised ciphertexts, each first
multiplied by its public weight in the weighted variant; the authority decrypts the aggregate
once per round. Message sizes are the serialised ciphertexts' lengths.

CKKS is approximate: every encryption adds noise, so sums are close (about 1e-8 absolute for
ten vectors in [-1, 1], more after a weight multiplication) but not exact, and since the noise
is drawn fresh each time, two runs of the same round differ in the low bits: results are not
bit-reproducible. Use the Paillier backend when exact sums matter.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tenseal as ts

from fedloom.secure.base import SecureAggregationConfigError
from fedloom.secure.he_protocol import (
    AggregatingServer,
    CiphertextUpload,
    DecryptedAggregate,
    EncryptedAggregation,
    PolicyKeyAuthority,
)
from fedloom.secure.transcript import Transcript

POLY_MODULUS_DEGREE = 8192
COEFF_MOD_BIT_SIZES = (60, 40, 40, 60)
GLOBAL_SCALE = 2**40
CHUNK = POLY_MODULUS_DEGREE // 2
"""Values per ciphertext: N/2 slots (larger vectors would not fit in one ciphertext)."""


def secret_context(n_threads: int | None = None) -> ts.Context:
    """A fresh CKKS context with the module's parameters, secret key included."""
    context = ts.context(
        ts.SCHEME_TYPE.CKKS,
        poly_modulus_degree=POLY_MODULUS_DEGREE,
        coeff_mod_bit_sizes=list(COEFF_MOD_BIT_SIZES),
        n_threads=n_threads,
    )
    context.global_scale = GLOBAL_SCALE
    return context


def public_context_bytes(context: ts.Context) -> bytes:
    """The context without its secret key (and without the keys a sum never uses)."""
    return context.serialize(
        save_public_key=True,
        save_secret_key=False,
        save_galois_keys=False,
        save_relin_keys=False,
    )


class CKKSKeyAuthority(PolicyKeyAuthority):
    """The only holder of the CKKS secret key; decrypts what its policy allows."""

    def __init__(self, min_contributors: int, n_threads: int | None = None) -> None:
        super().__init__(min_contributors)
        self._context = secret_context(n_threads)
        self.public_context = public_context_bytes(self._context)

    def decrypt_ciphertexts(self, ciphertexts: tuple[Any, ...]) -> np.ndarray:
        values = [ts.ckks_vector_from(self._context, c).decrypt() for c in ciphertexts]
        return np.concatenate(values).astype(np.float64)


class CKKSClient:
    """One client: clip and encrypt in 4,096-value chunks under the public context."""

    def __init__(self, client: int, public_context: ts.Context, clip: float) -> None:
        self.client = client
        self.public_context = public_context
        self.clip = clip

    def upload(self, round: int, x: np.ndarray, weight: int = 1) -> CiphertextUpload:
        x = np.asarray(x, dtype=np.float64)
        if not np.all(np.isfinite(x)):
            raise ValueError("cannot encrypt non-finite values (NaN or inf)")
        x = np.clip(x, -self.clip, self.clip)
        chunks = tuple(
            ts.ckks_vector(self.public_context, x[i : i + CHUNK]).serialize()
            for i in range(0, x.size, CHUNK)
        )
        return CiphertextUpload(round, self.client, chunks, weight)


class CKKSServer(AggregatingServer):
    """Holds the public context only: adds uploads (each times its weight) chunk by chunk."""

    def __init__(self, public_context: ts.Context) -> None:
        super().__init__()
        self.public_context = public_context

    def fold(self, aggregate: list[Any] | None, upload: CiphertextUpload) -> list[Any]:
        chunks = [ts.ckks_vector_from(self.public_context, c) for c in upload.ciphertexts]
        if upload.weight != 1:
            chunks = [c * float(upload.weight) for c in chunks]
        if aggregate is None:
            return chunks
        for total, chunk in zip(aggregate, chunks, strict=True):
            total.add_(chunk)
        return aggregate

    def serialize(self, aggregate: list[Any]) -> tuple[Any, ...]:
        return tuple(c.serialize() for c in aggregate)


class CKKSAggregation(EncryptedAggregation):
    """CKKS-encrypted (weighted) FedAvg with a key authority (Cheon et al. 2017; TenSEAL);
    ``sum`` is the ``SecureSum`` entry point, ``weighted_sum`` the weighted variant.

    ``clip``: coordinates are clipped to [-clip, clip] (8.0 as for the other protocols;
    CKKS itself only needs values well below 2^19 with these parameters);
    ``min_contributors``: the authority's K_min (2, as for Paillier); ``max_weight``: the
    largest weight :meth:`weighted_sum` accepts (None: any; the absolute error grows in
    proportion to the weights); ``n_threads``: TenSEAL's thread count (None: all cores).
    Nothing here is seeded: SEAL draws its own randomness.
    """

    key_authority: CKKSKeyAuthority
    server: CKKSServer

    def __init__(
        self,
        clip: float = 8.0,
        min_contributors: int = 2,
        max_weight: int | None = None,
        *,
        n_threads: int | None = None,
        transcript: Transcript | None = None,
    ) -> None:
        super().__init__()
        if not (np.isfinite(clip) and clip > 0):
            raise SecureAggregationConfigError(f"clip={clip}: must be a positive number")
        self.clip, self.max_weight = float(clip), max_weight
        self.key_authority = CKKSKeyAuthority(min_contributors, n_threads)
        public = self.key_authority.public_context
        self._public_context = ts.context_from(public, n_threads=n_threads)
        self.server = CKKSServer(self._public_context)
        self.transcript = transcript if transcript is not None else Transcript()
        self.publish_key()

    def client(self, client: int) -> CKKSClient:
        return CKKSClient(client, self._public_context, self.clip)

    def public_key_message(self) -> tuple[bytes, int]:
        public = self.key_authority.public_context
        return public, len(public)

    def ciphertexts_nbytes(self, ciphertexts: tuple[Any, ...]) -> int:
        return sum(len(c) for c in ciphertexts)

    def plaintexts_nbytes(self, plaintexts: np.ndarray) -> int:
        return int(plaintexts.nbytes)

    def decode(self, answer: DecryptedAggregate, length: int) -> tuple[np.ndarray, None]:
        return answer.plaintexts[:length], None
