"""Paillier building blocks over ``phe``: keys, fixed-point encoding, slot packing.

See docs/secure_aggregation.md. Nothing here is FedAvg-specific, so the vertical-FL protocols
(secure linear regression, SecureBoost) reuse the same helpers:

- :func:`generate_keypair` (``phe``; with ``gmpy2`` installed ``phe`` uses it on its own);
- :class:`FixedPoint`: clip to [-c, c], q = round(x·2^f) + round(c·2^f) >= 0 (equal to
  q = round((x + c)·2^f) whenever c·2^f is an integer), and decoding of (weighted) sums;
- :func:`slot_bits` and :class:`SlotPacking`: S slots of b bits per plaintext, with
  b = q_bits + ⌈log2(K·w_max)⌉ + 1 and S = ⌊(bits(n) − 2)/b⌋, so a sum of K encodings each
  weighted by at most w_max never carries into the next slot and the packed plaintext stays
  below 2^(bits(n) − 2) <= n/2, so sums never wrap modulo n;
- :func:`encrypt_packed` / :func:`decrypt_packed` (``raw_encrypt`` / ``raw_decrypt``: phe's
  ``encrypt`` of an int only accepts |m| <= n/3), :func:`add_ciphertexts` (⊕) and
  :func:`scale_ciphertexts` (⊗ a public non-negative integer);
- signed integers (vertical FL, docs/vertical.md "Encoding and masks"): a plaintext
  m with |m| < n/2 is stored as m mod n (:func:`encrypt_ints`) and read back by the centred
  lift to (−n/2, n/2] (:func:`decrypt_ints`); :func:`linear_combination` (Σ w_i ⊗ [[m_i]] for
  public signed integers w_i), :func:`subtract_ciphertexts` and :func:`rerandomize` (a fresh
  r^n factor, so that a ciphertext derived from someone's own ciphertexts reveals nothing
  through its randomness when sent back to them).

All modular arithmetic is phe's; this module only arranges integers.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from phe import paillier
from phe.util import invert, mulmod, powmod

from fedloom.secure.base import SecureAggregationConfigError

PublicKey = paillier.PaillierPublicKey
PrivateKey = paillier.PaillierPrivateKey
Ciphertext = paillier.EncryptedNumber

DEFAULT_KEY_BITS = 2048
"""112-bit security (NIST SP 800-57; 1024 for tests only, 3072 for 128-bit)."""

_MAX_VALUE_BITS = 62  # encodings live in int64 arrays


class PackingOverflowError(SecureAggregationConfigError):
    """A slot layout that cannot hold the declared sums (raised at setup, never at decode)."""


@dataclass(frozen=True)
class PaillierKeypair:
    """A Paillier key pair; whoever holds it can decrypt (the key authority's secret)."""

    public_key: PublicKey
    private_key: PrivateKey

    @property
    def key_bits(self) -> int:
        return self.public_key.n.bit_length()


def generate_keypair(key_bits: int = DEFAULT_KEY_BITS) -> PaillierKeypair:
    """A fresh key pair with an n of exactly ``key_bits`` bits (OS randomness, never seeded)."""
    if key_bits < 512 or key_bits % 256:
        raise SecureAggregationConfigError(
            f"key_bits={key_bits}: use a multiple of 256 of at least 512 (1024 for tests, "
            "2048 default, 3072 for 128-bit security)"
        )
    public_key, private_key = paillier.generate_paillier_keypair(n_length=key_bits)
    return PaillierKeypair(public_key, private_key)


def ciphertext_bytes(public_key: PublicKey) -> int:
    """Serialised size of one ciphertext: ⌈bits(n²)/8⌉."""
    return (public_key.nsquare.bit_length() + 7) // 8


def public_key_bytes(public_key: PublicKey) -> int:
    """Serialised size of a public key (its n): ⌈bits(n)/8⌉."""
    return (public_key.n.bit_length() + 7) // 8


@dataclass(frozen=True)
class FixedPoint:
    """Fixed-point encoding of floats in [-clip, clip] as non-negative integers.

    ``encode``: q = round(clip(x)·2^f) + offset with offset = round(clip·2^f), so
    0 <= q <= 2·offset < 2^value_bits. A sum of encodings with integer weights w_k decodes as
    (Σ w_k q_k − (Σ w_k)·offset) / 2^f, off by at most Σ w_k·2^-(f+1) from Σ w_k·clip(x_k).
    """

    clip: float
    frac_bits: int

    def __post_init__(self) -> None:
        if not (math.isfinite(self.clip) and self.clip > 0):
            raise SecureAggregationConfigError(f"clip={self.clip}: must be a positive number")
        if not (isinstance(self.frac_bits, int) and self.frac_bits >= 0):
            raise SecureAggregationConfigError(
                f"frac_bits={self.frac_bits}: must be a non-negative integer"
            )
        if self.offset < 1 or self.value_bits > _MAX_VALUE_BITS:
            raise SecureAggregationConfigError(
                f"clip={self.clip}, frac_bits={self.frac_bits}: encodings need "
                f"{self.value_bits} bits (at most {_MAX_VALUE_BITS}) and clip·2^f >= 1"
            )

    @property
    def scale(self) -> int:
        return 1 << self.frac_bits

    @property
    def offset(self) -> int:
        """The integer added to every encoding: round(clip·2^f)."""
        return round(self.clip * self.scale)

    @property
    def value_bits(self) -> int:
        """q_bits = f + ⌈log2 2c⌉ + 1, widened if rounding ever needs more."""
        spec_bits = self.frac_bits + math.ceil(math.log2(2 * self.clip)) + 1
        return max(spec_bits, (2 * self.offset).bit_length(), 1)

    def encode(self, x: np.ndarray) -> np.ndarray:
        """int64 encodings in [0, 2·offset] of ``x`` clipped to [-clip, clip]."""
        x = np.asarray(x, dtype=np.float64)
        if not np.all(np.isfinite(x)):
            raise ValueError("cannot encode non-finite values (NaN or inf) as fixed point")
        scaled = np.rint(np.clip(x, -self.clip, self.clip) * self.scale).astype(np.int64)
        return np.clip(scaled + self.offset, 0, 2 * self.offset)

    def decode_sum(self, sums: np.ndarray, weight_sum: int = 1) -> np.ndarray:
        """float64 Σ w_k·x_k from Σ w_k·q_k, given Σ w_k (``weight_sum``; 1 for a single q)."""
        sums = np.asarray(sums)
        if sums.dtype == object:  # slot sums wider than int64
            centred = [int(s) - weight_sum * self.offset for s in sums]
            return np.array([c / self.scale for c in centred], dtype=np.float64)
        return (sums.astype(np.int64) - weight_sum * self.offset) / self.scale


def slot_bits(value_bits: int, max_terms: int, max_weight: int = 1) -> int:
    """b = value_bits + ⌈log2(K·w_max)⌉ + 1: the width that holds Σ_{k<=K} w_k·q_k, w_k <= w_max."""
    if max_terms < 1 or max_weight < 1:
        raise SecureAggregationConfigError(
            f"max_terms={max_terms}, max_weight={max_weight}: both must be >= 1"
        )
    return value_bits + (max_terms * max_weight - 1).bit_length() + 1


@dataclass(frozen=True)
class SlotPacking:
    """``slots`` non-negative integers of ``slot_bits`` bits each per Paillier plaintext."""

    slot_bits: int
    slots: int

    @classmethod
    def for_key(cls, key_bits: int, slot_bits: int) -> SlotPacking:
        """S = ⌊(bits(n) − 2)/b⌋ slots; raises :class:`PackingOverflowError` when S < 1."""
        slots = (key_bits - 2) // slot_bits if slot_bits >= 1 else 0
        if slots < 1:
            raise PackingOverflowError(
                f"a {slot_bits}-bit slot does not fit in a {key_bits}-bit Paillier plaintext "
                f"(at most {key_bits - 2} bits): lower the number of clients, max_weight or "
                "frac_bits, or use a larger key"
            )
        return cls(slot_bits, slots)

    @property
    def plaintext_bytes(self) -> int:
        return (self.slots * self.slot_bits + 7) // 8

    def count(self, length: int) -> int:
        """Plaintexts (hence ciphertexts) needed for ``length`` values."""
        return -(-length // self.slots)

    def pack(self, values: np.ndarray) -> list[int]:
        """Little-endian slots: value i goes to bits [b·(i mod S), b·(i mod S + 1)) of
        plaintext i // S. ``values``: non-negative integers below 2^min(b, 63)."""
        values = np.asarray(values)
        if values.ndim != 1 or values.dtype.kind not in "iu":
            raise ValueError("pack expects a 1-D integer array")
        width = min(self.slot_bits, 63)
        if values.size and (values.min() < 0 or int(values.max()) >> width):
            raise PackingOverflowError(f"values must lie in [0, 2^{width}) to be packed")
        n_plain = self.count(values.size)
        if n_plain == 0:
            return []
        padded = np.zeros(n_plain * self.slots, dtype="<u8")
        padded[: values.size] = values
        # one bit per column, little-endian: (values, 64) -> (values, b)
        bits = np.unpackbits(padded.view(np.uint8).reshape(-1, 8), axis=1, bitorder="little")
        if self.slot_bits <= 64:
            bits = bits[:, : self.slot_bits]
        else:
            bits = np.pad(bits, ((0, 0), (0, self.slot_bits - 64)))
        rows = np.packbits(bits.reshape(n_plain, -1), axis=1, bitorder="little")
        return [int.from_bytes(row.tobytes(), "little") for row in rows]

    def unpack(self, plaintexts: Sequence[int], length: int) -> np.ndarray:
        """The first ``length`` slot values of ``plaintexts``: int64 when b <= 63, otherwise
        an object array of Python ints."""
        if length > len(plaintexts) * self.slots:
            raise ValueError(f"{len(plaintexts)} plaintexts hold fewer than {length} slots")
        if length == 0:
            return np.zeros(0, dtype=np.int64 if self.slot_bits <= 63 else object)
        nbytes = self.plaintext_bytes
        try:
            raw = b"".join(int(p).to_bytes(nbytes, "little") for p in plaintexts)
        except OverflowError as err:
            raise PackingOverflowError(
                f"a plaintext exceeds {self.slots}×{self.slot_bits} bits: slots overflowed"
            ) from err
        rows = np.frombuffer(raw, dtype=np.uint8).reshape(len(plaintexts), nbytes)
        bits = np.unpackbits(rows, axis=1, bitorder="little")[:, : self.slots * self.slot_bits]
        bits = bits.reshape(-1, self.slot_bits)[:length]
        if self.slot_bits <= 63:
            words = np.packbits(
                np.pad(bits, ((0, 0), (0, 64 - self.slot_bits))), axis=1, bitorder="little"
            )
            return words.reshape(-1).view("<u8").astype(np.int64)
        slot_bytes = np.packbits(bits, axis=1, bitorder="little")
        return np.array([int.from_bytes(r.tobytes(), "little") for r in slot_bytes], dtype=object)


def encrypt_packed(public_key: PublicKey, plaintexts: Iterable[int]) -> list[Ciphertext]:
    """[[m]] for each packed plaintext 0 <= m < n (phe's ``raw_encrypt``, obfuscated)."""
    return [Ciphertext(public_key, public_key.raw_encrypt(int(m))) for m in plaintexts]


def decrypt_packed(private_key: PrivateKey, ciphertexts: Iterable[Ciphertext]) -> list[int]:
    """The packed plaintexts (phe's ``raw_decrypt``)."""
    return [private_key.raw_decrypt(c.ciphertext(be_secure=False)) for c in ciphertexts]


def add_ciphertexts(a: Sequence[Ciphertext], b: Sequence[Ciphertext]) -> list[Ciphertext]:
    """Elementwise [[x]] ⊕ [[y]] = [[x + y]]."""
    if len(a) != len(b):
        raise ValueError(f"cannot add ciphertext vectors of lengths {len(a)} and {len(b)}")
    return [x + y for x, y in zip(a, b, strict=True)]


def sum_ciphertexts(vectors: Iterable[Sequence[Ciphertext]]) -> list[Ciphertext]:
    """Elementwise ⊕ over several ciphertext vectors of one length."""
    total: list[Ciphertext] | None = None
    for vector in vectors:
        total = list(vector) if total is None else add_ciphertexts(total, vector)
    if total is None:
        raise ValueError("sum_ciphertexts needs at least one vector")
    return total


def scale_ciphertexts(vector: Sequence[Ciphertext], weight: int) -> list[Ciphertext]:
    """Elementwise [[x]] ⊗ w = [[w·x]] for a public integer 0 <= w (a ciphertext power)."""
    if not isinstance(weight, int | np.integer) or weight < 0:
        raise ValueError(f"weight={weight}: must be a non-negative integer")
    if weight == 1:
        return list(vector)
    return [c * int(weight) for c in vector]


def encrypt_ints(public_key: PublicKey, values: Iterable[int]) -> list[Ciphertext]:
    """[[m]] (exponent 0, fresh randomness each) of signed integers |m| < n/2, stored mod n."""
    n = public_key.n
    out = []
    for m in values:
        m = int(m)
        if 2 * abs(m) >= n:
            raise PackingOverflowError(f"|m| >= n/2 ({m.bit_length()} bits): cannot be encrypted")
        out.append(Ciphertext(public_key, public_key.raw_encrypt(m % n), 0))
    return out


def decrypt_ints(private_key: PrivateKey, ciphertexts: Iterable[Ciphertext]) -> list[int]:
    """The signed plaintexts: the centred lift of ``raw_decrypt`` to (−n/2, n/2]."""
    n = private_key.public_key.n
    out = []
    for c in ciphertexts:
        m = private_key.raw_decrypt(c.ciphertext(be_secure=False))
        out.append(m - n if 2 * m > n else m)
    return out


def linear_combination(ciphertexts: Sequence[Ciphertext], weights: Sequence[int]) -> Ciphertext:
    """[[Σ_i w_i m_i]] for public signed integer weights w_i (zero weights cost nothing):
    Π_i c_i^{w_i} mod n², a negative weight as a power of the inverse ciphertext."""
    if len(ciphertexts) != len(weights) or not ciphertexts:
        raise ValueError(
            f"linear_combination needs as many weights ({len(weights)}) as ciphertexts "
            f"({len(ciphertexts)}), at least one"
        )
    public_key = ciphertexts[0].public_key
    nsquare = public_key.nsquare
    acc = 1
    for c, w in zip(ciphertexts, weights, strict=True):
        w = int(w)
        if w == 0:
            continue
        raw = c.ciphertext(be_secure=False)
        if w < 0:
            raw, w = invert(raw, nsquare), -w
        acc = mulmod(acc, raw if w == 1 else powmod(raw, w, nsquare), nsquare)
    return Ciphertext(public_key, int(acc), 0)


def subtract_ciphertexts(a: Sequence[Ciphertext], b: Sequence[Ciphertext]) -> list[Ciphertext]:
    """Elementwise [[x]] ⊖ [[y]] = [[x − y]] (a ciphertext times the inverse of the other)."""
    if len(a) != len(b):
        raise ValueError(f"cannot subtract ciphertext vectors of lengths {len(a)} and {len(b)}")
    out = []
    for x, y in zip(a, b, strict=True):
        nsquare = x.public_key.nsquare
        raw = mulmod(
            x.ciphertext(be_secure=False), invert(y.ciphertext(be_secure=False), nsquare), nsquare
        )
        out.append(Ciphertext(x.public_key, int(raw), x.exponent))
    return out


def rerandomize(ciphertexts: Iterable[Ciphertext]) -> list[Ciphertext]:
    """Copies multiplied by a fresh r^n (same plaintexts, unlinkable randomness)."""
    out = []
    for c in ciphertexts:
        fresh = Ciphertext(c.public_key, c.ciphertext(be_secure=False), c.exponent)
        fresh.obfuscate()
        out.append(fresh)
    return out
