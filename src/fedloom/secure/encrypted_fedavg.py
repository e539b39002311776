"""Paillier-encrypted FedAvg (docs/secure_aggregation.md) as a :class:`SecureSum`.

Per round: clients clip, encode (q = round(x·2^f) + round(c·2^f)), pack S slots per
plaintext and encrypt under the key authority's public key; the server multiplies the
ciphertexts (⊕), each first raised to its client's public integer weight n_k (⊗) in the
weighted variant; the key authority decrypts only that aggregate, once; the server unpacks and
decodes Σ n_k x_k = (Σ n_k q_k − (Σ n_k)·round(c·2^f)) / 2^f. The decoded integer sums are
exact; each client's rounding costs at most 2^-(f+1) per coordinate, so a (weighted) mean is
within 2^-(f+1) of the mean of the clipped floats.

Slots are sized at setup for ``max_clients`` uploads of weight at most ``max_weight``
(b = q_bits + ⌈log2(K·w_max)⌉ + 1); a configuration that cannot fit raises
:class:`~fedloom.secure.paillier.PackingOverflowError` in the constructor, and a round with
more uploads or a larger weight raises before any client encrypts.
"""

from __future__ import annotations

import numpy as np

from fedloom.secure.he_protocol import (
    AggregatingServer,
    CiphertextUpload,
    DecryptedAggregate,
    EncryptedAggregation,
    PolicyKeyAuthority,
)
from fedloom.secure.paillier import (
    DEFAULT_KEY_BITS,
    Ciphertext,
    FixedPoint,
    PackingOverflowError,
    PaillierKeypair,
    PublicKey,
    SlotPacking,
    add_ciphertexts,
    ciphertext_bytes,
    decrypt_packed,
    encrypt_packed,
    generate_keypair,
    public_key_bytes,
    scale_ciphertexts,
    slot_bits,
)
from fedloom.secure.transcript import Transcript


class PaillierKeyAuthority(PolicyKeyAuthority):
    """The only holder of the secret key: decrypts a round aggregate if the
    :class:`~fedloom.secure.he_protocol.DecryptionPolicy` allows it."""

    def __init__(self, keypair: PaillierKeypair, min_contributors: int) -> None:
        super().__init__(min_contributors)
        self._keypair = keypair

    @property
    def public_key(self) -> PublicKey:
        return self._keypair.public_key

    def decrypt_ciphertexts(self, ciphertexts: tuple[Ciphertext, ...]) -> tuple[int, ...]:
        return tuple(decrypt_packed(self._keypair.private_key, ciphertexts))


class PaillierClient:
    """One client: clip, encode, pack, encrypt under the authority's public key."""

    def __init__(
        self, client: int, public_key: PublicKey, codec: FixedPoint, packing: SlotPacking
    ) -> None:
        self.client = client
        self.public_key = public_key
        self.codec = codec
        self.packing = packing

    def upload(self, round: int, x: np.ndarray, weight: int = 1) -> CiphertextUpload:
        plaintexts = self.packing.pack(self.codec.encode(x))
        ciphertexts = encrypt_packed(self.public_key, plaintexts)
        return CiphertextUpload(round, self.client, tuple(ciphertexts), weight)


class PaillierServer(AggregatingServer):
    """Holds only public material: folds uploads into the encrypted aggregate (each ⊗ its
    weight), asks the authority for its plaintext, unpacks and decodes it."""

    def __init__(self, public_key: PublicKey, codec: FixedPoint, packing: SlotPacking) -> None:
        super().__init__()
        self.public_key = public_key
        self.codec = codec
        self.packing = packing

    def fold(
        self, aggregate: list[Ciphertext] | None, upload: CiphertextUpload
    ) -> list[Ciphertext]:
        weighted = scale_ciphertexts(upload.ciphertexts, upload.weight)
        return weighted if aggregate is None else add_ciphertexts(aggregate, weighted)

    def serialize(self, aggregate: list[Ciphertext]) -> tuple[Ciphertext, ...]:
        return tuple(aggregate)

    def decode(self, answer: DecryptedAggregate, length: int) -> tuple[np.ndarray, np.ndarray]:
        """(Σ n_k x_k as float64, Σ n_k q_k as integers) from the authority's answer."""
        slot_sums = self.packing.unpack(answer.plaintexts, length)
        return self.codec.decode_sum(slot_sums, self._weight_sum), slot_sums


class PaillierAggregation(EncryptedAggregation):
    """Paillier-encrypted (weighted) FedAvg with slot packing and a key authority (Paillier 1999);
    ``sum`` is the ``SecureSum`` entry point, ``weighted_sum`` the weighted variant.

    ``clip``: coordinates are clipped to [-clip, clip] (8.0, as SecAgg's and Flower's
    default, so that switching protocols keeps the clipping; the error does not depend on it,
    a larger clip only widens the slots); ``frac_bits``: f fractional bits
    (16: mean error <= 2^-17); ``key_bits``: 2048 default (112-bit),
    1024 for tests only, 3072 for 128-bit; ``max_clients`` (K) and ``max_weight`` (w_max)
    size the slots: a round may sum at most K uploads with integer weights <= w_max (1 for
    the unweighted :meth:`sum`; set it to the largest n_k for :meth:`weighted_sum`);
    ``min_contributors``: the key authority's K_min (2: it never decrypts one client's
    ciphertext as declared; raise it for more privacy). Nothing here is seeded (phe draws
    its randomness from the OS), and the decoded sum is exact, so runs reproduce regardless.
    ``keypair``: reuse keys (tests); otherwise the authority generates them. ``transcript``:
    where messages are recorded (a fresh one by default).
    """

    key_authority: PaillierKeyAuthority
    server: PaillierServer

    def __init__(
        self,
        clip: float = 8.0,
        frac_bits: int = 16,
        key_bits: int = DEFAULT_KEY_BITS,
        max_clients: int = 100,
        max_weight: int = 1,
        min_contributors: int = 2,
        *,
        keypair: PaillierKeypair | None = None,
        transcript: Transcript | None = None,
    ) -> None:
        super().__init__()
        self.codec = FixedPoint(float(clip), frac_bits)
        self.max_clients, self.max_weight = max_clients, max_weight
        if keypair is not None:
            key_bits = keypair.key_bits
        width = slot_bits(self.codec.value_bits, max_clients, max_weight)
        self.packing = SlotPacking.for_key(key_bits, width)  # overflow guard, before keygen
        self.key_authority = PaillierKeyAuthority(
            keypair or generate_keypair(key_bits), min_contributors
        )
        self.server = PaillierServer(self.key_authority.public_key, self.codec, self.packing)
        self.transcript = transcript if transcript is not None else Transcript()
        self.publish_key()

    @property
    def public_key(self) -> PublicKey:
        return self.key_authority.public_key

    def client(self, client: int) -> PaillierClient:
        return PaillierClient(client, self.public_key, self.codec, self.packing)

    def public_key_message(self) -> tuple[PublicKey, int]:
        return self.public_key, public_key_bytes(self.public_key)

    def ciphertexts_nbytes(self, ciphertexts: tuple[Ciphertext, ...]) -> int:
        return len(ciphertexts) * ciphertext_bytes(self.public_key)

    def plaintexts_nbytes(self, plaintexts: tuple[int, ...]) -> int:
        return len(plaintexts) * self.packing.plaintext_bytes

    def decode(self, answer: DecryptedAggregate, length: int) -> tuple[np.ndarray, np.ndarray]:
        return self.server.decode(answer, length)

    def check_capacity(self, round: int, senders: list[int]) -> None:
        if len(senders) > self.max_clients:
            raise PackingOverflowError(
                f"round {round}: {len(senders)} uploads exceed max_clients={self.max_clients} "
                "the slots were sized for"
            )
