"""Arrays under additively homomorphic encryption, and the plaintext stand-in that lets the
plaintext path run the very same protocol code (docs/vertical.md, "Encoding and
masks").

A protocol holds one :class:`HEBackend` per key it uses: the key owner's backend can decrypt,
everyone else's holds the public key only. Two backends:

- :class:`PaillierBackend`: reals as fixed-point integers round(v·2^f) (f = 32 by default,
  Paillier exponent 0) in a :class:`PaillierArray` that tracks its scale 2^s: a product
  x ⊗ [[d]] with a plaintext encoded at 2^f carries 2^(s+f); adding arrays of different scales
  first lifts the smaller one by ⊗ 2^Δ (exact). Each array also carries a bound on the bits of
  its plaintexts, computed from public constants only (inputs |v| < 2^value_bits), so that an
  overflow is an error, never a wrong number.
- :class:`PlainBackend`: :class:`PlainArray` wraps float64 arrays; every operation is the
  ordinary one, masks are zero. Used for speed and as the oracle in tests.

Masks (statistically hiding): for an array whose plaintexts satisfy |g| < 2^b, b = bits(n) − 84,
R is drawn uniformly from [0, 2^(b+80)) per entry (``secrets`` by default) and added as a fresh
encryption (which also re-randomises the ciphertext): g + R is within statistical distance
2^-80 of uniform and stays in (−n/2, n/2), so its centred decryption is exact. The owner of g
removes R after the key holder decrypts. Float masks on phe's float encodings would not hide.
"""

from __future__ import annotations

import math
import random
import secrets
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from fedloom.secure.paillier import (
    Ciphertext,
    PackingOverflowError,
    PaillierKeypair,
    PrivateKey,
    PublicKey,
    ciphertext_bytes,
    decrypt_ints,
    encrypt_ints,
    linear_combination,
    rerandomize,
)
from fedloom.vertical.messages import Channel

STATISTICAL_BITS = 80
"""Masks are 2^80 times wider than the values they hide (statistical distance <= 2^-80)."""
DEFAULT_FRAC_BITS = 32
DEFAULT_VALUE_BITS = 32
"""Public bound on plaintext inputs: |v| < 2^32 (encoding refuses anything larger)."""


class EncryptedArray(ABC):
    """An array under some key (or, in the plaintext path, in the clear)."""

    @property
    @abstractmethod
    def shape(self) -> tuple[int, ...]: ...

    @property
    @abstractmethod
    def nbytes(self) -> int: ...


@dataclass(frozen=True, eq=False)
class PlainArray(EncryptedArray):
    """The plaintext path's stand-in for a ciphertext array: the float64 values themselves."""

    values: np.ndarray

    def __post_init__(self) -> None:
        object.__setattr__(self, "values", np.asarray(self.values, dtype=np.float64))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.values.shape

    @property
    def nbytes(self) -> int:
        return int(self.values.nbytes)


@dataclass(frozen=True, eq=False)
class PaillierArray(EncryptedArray):
    """Paillier ciphertexts (an object array of ``EncryptedNumber``) of fixed-point integers
    at scale 2^scale, with |plaintext| < 2^bound (a public bound)."""

    cts: np.ndarray
    scale: int
    bound: int
    public_key: PublicKey

    @property
    def shape(self) -> tuple[int, ...]:
        return self.cts.shape

    @property
    def nbytes(self) -> int:
        return int(self.cts.size) * ciphertext_bytes(self.public_key)


@dataclass(frozen=True, eq=False)
class MaskedValues:
    """What the key holder returns after decrypting a masked array: g + R (integers, or the
    plain floats in the plaintext path)."""

    values: np.ndarray

    @property
    def nbytes(self) -> int:
        if self.values.dtype != object:
            return int(self.values.nbytes)
        return sum(max(1, (abs(int(v)).bit_length() + 8) // 8) for v in self.values.ravel())


@dataclass(frozen=True, eq=False)
class Mask:
    """The masking party's secret: R per entry and the scale of the masked array."""

    values: np.ndarray
    scale: int


def _as_objects(x: Any) -> np.ndarray:
    """numpy turns 0-d object arithmetic into a bare element: wrap it back."""
    if isinstance(x, np.ndarray):
        return x
    out = np.empty((), dtype=object)
    out[()] = x
    return out


def _objects(shape: tuple[int, ...], items: list[Any]) -> np.ndarray:
    out = np.empty(len(items), dtype=object)
    out[:] = items
    return out.reshape(shape)


class HEBackend(ABC):
    """The operations a protocol performs on encrypted arrays; ``can_decrypt`` is True only
    for the key owner's backend."""

    encrypted: bool
    can_decrypt: bool

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    @abstractmethod
    def encrypt(self, x: np.ndarray) -> EncryptedArray: ...
    @abstractmethod
    def decrypt(self, a: EncryptedArray) -> np.ndarray: ...
    @abstractmethod
    def add(self, a: EncryptedArray, b: EncryptedArray) -> EncryptedArray: ...
    @abstractmethod
    def add_plain(self, a: EncryptedArray, x: np.ndarray) -> EncryptedArray:
        """[[a]] ⊕ x (x broadcast to a's shape)."""

    @abstractmethod
    def mul_plain(self, a: EncryptedArray, x: np.ndarray | float) -> EncryptedArray:
        """[[a]] ⊗ x elementwise (x broadcast)."""

    @abstractmethod
    def matmul_plain(self, p: np.ndarray, a: EncryptedArray) -> EncryptedArray:
        """P @ [[a]] for a plaintext matrix P (m×n) and a of shape (n,) or (n, k)."""

    @abstractmethod
    def rmatmul_plain(self, a: EncryptedArray, p: np.ndarray) -> EncryptedArray:
        """[[a]] @ P for a of shape (n,) or (m, n) and a plaintext P (n×k)."""

    @abstractmethod
    def sum(self, a: EncryptedArray, axis: int | None = None) -> EncryptedArray: ...
    @abstractmethod
    def stack(self, arrays: list[EncryptedArray], axis: int = 0) -> EncryptedArray: ...
    @abstractmethod
    def take(self, a: EncryptedArray, index: np.ndarray | int, axis: int = 0) -> EncryptedArray:
        """Entries ``index`` of ``a`` along ``axis`` (numpy's ``take``)."""

    @abstractmethod
    def mask(self, a: EncryptedArray) -> tuple[EncryptedArray, Mask | None]:
        """[[a + R]] (re-randomised) and R, kept by the caller."""

    @abstractmethod
    def decrypt_masked(self, a: EncryptedArray) -> MaskedValues: ...
    @abstractmethod
    def unmask(self, values: MaskedValues, mask: Mask | None) -> np.ndarray: ...
    @abstractmethod
    def rerandomize(self, a: EncryptedArray) -> EncryptedArray: ...

    def add_many(self, *arrays: EncryptedArray) -> EncryptedArray:
        total = arrays[0]
        for a in arrays[1:]:
            total = self.add(total, a)
        return total


class PlainBackend(HEBackend):
    """The plaintext path: float64 arithmetic, zero masks, identity 'encryption'."""

    encrypted = False
    can_decrypt = True

    def encrypt(self, x: np.ndarray) -> PlainArray:
        return PlainArray(np.array(x, dtype=np.float64))

    def decrypt(self, a: EncryptedArray) -> np.ndarray:
        return _plain(a).copy()

    def add(self, a: EncryptedArray, b: EncryptedArray) -> PlainArray:
        return PlainArray(_plain(a) + _plain(b))

    def add_plain(self, a: EncryptedArray, x: np.ndarray) -> PlainArray:
        return PlainArray(_plain(a) + np.asarray(x, dtype=np.float64))

    def mul_plain(self, a: EncryptedArray, x: np.ndarray | float) -> PlainArray:
        return PlainArray(_plain(a) * np.asarray(x, dtype=np.float64))

    def matmul_plain(self, p: np.ndarray, a: EncryptedArray) -> PlainArray:
        return PlainArray(np.asarray(p, dtype=np.float64) @ _plain(a))

    def rmatmul_plain(self, a: EncryptedArray, p: np.ndarray) -> PlainArray:
        return PlainArray(_plain(a) @ np.asarray(p, dtype=np.float64))

    def sum(self, a: EncryptedArray, axis: int | None = None) -> PlainArray:
        return PlainArray(np.asarray(_plain(a).sum(axis=axis)))

    def stack(self, arrays: list[EncryptedArray], axis: int = 0) -> PlainArray:
        return PlainArray(np.stack([_plain(a) for a in arrays], axis=axis))

    def take(self, a: EncryptedArray, index: np.ndarray | int, axis: int = 0) -> PlainArray:
        return PlainArray(np.take(_plain(a), index, axis=axis))

    def mask(self, a: EncryptedArray) -> tuple[PlainArray, None]:
        return PlainArray(_plain(a)), None

    def decrypt_masked(self, a: EncryptedArray) -> MaskedValues:
        return MaskedValues(_plain(a).copy())

    def unmask(self, values: MaskedValues, mask: Mask | None) -> np.ndarray:
        return np.asarray(values.values, dtype=np.float64)

    def rerandomize(self, a: EncryptedArray) -> PlainArray:
        return PlainArray(_plain(a))


def _plain(a: EncryptedArray) -> np.ndarray:
    if not isinstance(a, PlainArray):
        raise TypeError(f"the plaintext backend got a {type(a).__name__}")
    return a.values


class PaillierBackend(HEBackend):
    """Paillier (Eurocrypt 1999) with fixed-point encoding (docs/vertical.md, "Encoding and
    masks"). ``keypair``: the key owner's pair (can decrypt); ``public_key``: anyone else's
    view of that key. ``mask_random``: the source of
    masks (``secrets`` unless a test passes a seeded ``random.Random``); ``zero_masks``: a
    debug hook that makes every mask 0 (tests only: then the key holder sees g itself)."""

    encrypted = True

    def __init__(
        self,
        channel: Channel,
        *,
        keypair: PaillierKeypair | None = None,
        public_key: PublicKey | None = None,
        frac_bits: int = DEFAULT_FRAC_BITS,
        value_bits: int = DEFAULT_VALUE_BITS,
        mask_random: random.Random | None = None,
        zero_masks: bool = False,
    ) -> None:
        super().__init__(channel)
        if keypair is None and public_key is None:
            raise ValueError("a Paillier backend needs a key pair or a public key")
        self.public_key: PublicKey = keypair.public_key if keypair else public_key  # type: ignore[assignment]
        self._private_key: PrivateKey | None = keypair.private_key if keypair else None
        self.can_decrypt = self._private_key is not None
        self.frac_bits = frac_bits
        self.value_bits = value_bits
        self.key_bits = self.public_key.n.bit_length()
        self.mask_bits = self.key_bits - 4
        self.max_hidden_bits = self.mask_bits - STATISTICAL_BITS
        self._random = mask_random or secrets.SystemRandom()
        self._zero_masks = zero_masks

    def public(self) -> PaillierBackend:
        """The backend other parties hold for this key: same settings (the debug hook and
        mask source included: they are the run's), no private key."""
        return PaillierBackend(
            self.channel,
            public_key=self.public_key,
            frac_bits=self.frac_bits,
            value_bits=self.value_bits,
            mask_random=self._random,
            zero_masks=self._zero_masks,
        )

    # -- encoding -------------------------------------------------------------------------
    def encode(self, x: np.ndarray | float, scale: int | None = None) -> np.ndarray:
        """round(x·2^f) as Python ints (object array), shifted to 2^scale when scale > f."""
        x = np.asarray(x, dtype=np.float64)
        if not np.all(np.isfinite(x)):
            raise ValueError("cannot encode NaN or inf as fixed point")
        if x.size and np.max(np.abs(x)) >= 2.0**self.value_bits:
            raise PackingOverflowError(
                f"a value of magnitude {np.max(np.abs(x)):.3g} exceeds the public bound "
                f"2^{self.value_bits} of the fixed-point encoding"
            )
        f = self.frac_bits
        ints = np.rint(x * 2.0**f)
        shift = 0 if scale is None else scale - f
        if shift < 0:
            raise ValueError(f"cannot encode at scale {scale} < frac_bits {f}")
        out = np.empty(x.shape, dtype=object)
        flat = out.reshape(-1)
        for i, v in enumerate(ints.reshape(-1)):
            flat[i] = int(v) << shift
        return out

    def _plain_bound(self) -> int:
        return self.value_bits + self.frac_bits

    def _wrap(self, cts: np.ndarray, scale: int, bound: int) -> PaillierArray:
        if bound > self.key_bits - 2:
            raise PackingOverflowError(
                f"plaintexts may need {bound} bits, more than a {self.key_bits}-bit key holds: "
                "use a larger key or fewer fractional bits"
            )
        return PaillierArray(cts, scale, bound, self.public_key)

    def _check(self, a: EncryptedArray) -> PaillierArray:
        if not isinstance(a, PaillierArray):
            raise TypeError(f"the Paillier backend got a {type(a).__name__}")
        if a.public_key != self.public_key:
            raise ValueError("the array is encrypted under another key")
        return a

    def _lift(self, a: PaillierArray, scale: int) -> PaillierArray:
        if scale == a.scale:
            return a
        factor = 1 << (scale - a.scale)
        cts = _as_objects(a.cts * factor)
        return PaillierArray(cts, scale, a.bound + scale - a.scale, a.public_key)

    # -- operations -------------------------------------------------------------------------
    def encrypt(self, x: np.ndarray) -> PaillierArray:
        ints = self.encode(x)
        with self.channel.crypto():
            cts = encrypt_ints(self.public_key, ints.reshape(-1))
        return self._wrap(_objects(ints.shape, cts), self.frac_bits, self._plain_bound())

    def _decrypt_ints(self, a: PaillierArray) -> np.ndarray:
        if self._private_key is None:
            raise PermissionError("only the key owner can decrypt")
        with self.channel.crypto():
            ints = decrypt_ints(self._private_key, a.cts.reshape(-1))
        return _objects(a.shape, ints)

    def decrypt(self, a: EncryptedArray) -> np.ndarray:
        a = self._check(a)
        ints = self._decrypt_ints(a)
        denom = 1 << a.scale
        return np.array([v / denom for v in ints.reshape(-1)], dtype=np.float64).reshape(a.shape)

    def add(self, a: EncryptedArray, b: EncryptedArray) -> PaillierArray:
        a, b = self._check(a), self._check(b)
        scale = max(a.scale, b.scale)
        with self.channel.crypto():
            a, b = self._lift(a, scale), self._lift(b, scale)
            cts = _as_objects(a.cts + b.cts)
        return self._wrap(cts, scale, max(a.bound, b.bound) + 1)

    def add_plain(self, a: EncryptedArray, x: np.ndarray) -> PaillierArray:
        a = self._check(a)
        plain = np.broadcast_to(self.encode(x, scale=max(a.scale, self.frac_bits)), a.shape)
        with self.channel.crypto():
            cts = _as_objects(a.cts + plain)
        bound = max(a.bound, self._plain_bound() + a.scale - self.frac_bits) + 1
        return self._wrap(cts, a.scale, bound)

    def mul_plain(self, a: EncryptedArray, x: np.ndarray | float) -> PaillierArray:
        a = self._check(a)
        ints = self.encode(x)
        with self.channel.crypto():
            cts = _as_objects(a.cts * ints)
        return self._wrap(cts, a.scale + self.frac_bits, a.bound + self._plain_bound())

    def matmul_plain(self, p: np.ndarray, a: EncryptedArray) -> PaillierArray:
        a = self._check(a)
        weights = self.encode(p)
        if weights.ndim != 2 or weights.shape[1] != a.shape[0]:
            raise ValueError(f"cannot multiply {weights.shape} by {a.shape}")
        cols = a.cts.reshape(a.shape[0], -1)
        with self.channel.crypto():
            items = [
                linear_combination(list(cols[:, k]), list(weights[j]))
                for j in range(weights.shape[0])
                for k in range(cols.shape[1])
            ]
        shape = (weights.shape[0], *a.shape[1:])
        bound = a.bound + self._plain_bound() + math.ceil(math.log2(max(2, a.shape[0])))
        return self._wrap(_objects(shape, items), a.scale + self.frac_bits, bound)

    def rmatmul_plain(self, a: EncryptedArray, p: np.ndarray) -> PaillierArray:
        a = self._check(a)
        weights = self.encode(p)
        if weights.ndim != 2 or weights.shape[0] != a.shape[-1]:
            raise ValueError(f"cannot multiply {a.shape} by {weights.shape}")
        rows = a.cts.reshape(-1, a.shape[-1])
        with self.channel.crypto():
            items = [
                linear_combination(list(rows[i]), list(weights[:, k]))
                for i in range(rows.shape[0])
                for k in range(weights.shape[1])
            ]
        shape = (*a.shape[:-1], weights.shape[1])
        bound = a.bound + self._plain_bound() + math.ceil(math.log2(max(2, a.shape[-1])))
        return self._wrap(_objects(shape, items), a.scale + self.frac_bits, bound)

    def sum(self, a: EncryptedArray, axis: int | None = None) -> PaillierArray:
        a = self._check(a)
        terms = a.cts.size if axis is None else a.shape[axis]
        with self.channel.crypto():
            cts = _as_objects(a.cts.sum(axis=axis))
        return self._wrap(cts, a.scale, a.bound + math.ceil(math.log2(max(2, terms))))

    def stack(self, arrays: list[EncryptedArray], axis: int = 0) -> PaillierArray:
        checked = [self._check(a) for a in arrays]
        scale = max(a.scale for a in checked)
        with self.channel.crypto():
            lifted = [self._lift(a, scale) for a in checked]
        cts = np.stack([a.cts for a in lifted], axis=axis)
        return self._wrap(cts, scale, max(a.bound for a in lifted))

    def take(self, a: EncryptedArray, index: np.ndarray | int, axis: int = 0) -> PaillierArray:
        a = self._check(a)
        return PaillierArray(np.take(a.cts, index, axis=axis), a.scale, a.bound, a.public_key)

    def mask(self, a: EncryptedArray) -> tuple[PaillierArray, Mask]:
        a = self._check(a)
        if a.bound > self.max_hidden_bits:
            raise PackingOverflowError(
                f"a {a.bound}-bit value cannot be hidden by a {self.mask_bits}-bit mask with "
                f"{STATISTICAL_BITS} bits of statistical security: use a larger key"
            )
        masks = self.draw_masks(a.cts.size)
        with self.channel.crypto():
            enc = encrypt_ints(self.public_key, masks)
            cts = _as_objects(a.cts + _objects(a.shape, enc))
        masked = PaillierArray(cts, a.scale, self.mask_bits + 1, a.public_key)
        return masked, Mask(_objects(a.shape, masks), a.scale)

    def draw_masks(self, count: int) -> list[int]:
        """``count`` masks uniform in [0, 2^(bits(n) − 4)) (zero with the debug hook)."""
        if self._zero_masks:
            return [0] * count
        return [self._random.getrandbits(self.mask_bits) for _ in range(count)]

    def decrypt_masked(self, a: EncryptedArray) -> MaskedValues:
        return MaskedValues(self._decrypt_ints(self._check(a)))

    def unmask(self, values: MaskedValues, mask: Mask | None) -> np.ndarray:
        if mask is None:
            raise ValueError("the Paillier path needs the mask that was added")
        denom = 1 << mask.scale
        diff = [
            (int(v) - int(r)) / denom
            for v, r in zip(values.values.reshape(-1), mask.values.reshape(-1), strict=True)
        ]
        return np.array(diff, dtype=np.float64).reshape(values.values.shape)

    def rerandomize(self, a: EncryptedArray) -> PaillierArray:
        a = self._check(a)
        with self.channel.crypto():
            cts = rerandomize(a.cts.reshape(-1))
        return PaillierArray(_objects(a.shape, cts), a.scale, a.bound, a.public_key)


BackendFactory = Callable[[Channel], HEBackend]


__all__ = [
    "Ciphertext",
    "EncryptedArray",
    "HEBackend",
    "Mask",
    "MaskedValues",
    "PaillierArray",
    "PaillierBackend",
    "PlainArray",
    "PlainBackend",
]


def new_key(
    channel: Channel,
    *,
    encrypt: bool,
    key_bits: int,
    frac_bits: int = DEFAULT_FRAC_BITS,
    mask_random: random.Random | None = None,
    zero_masks: bool = False,
) -> HEBackend:
    """A key owner's backend: a fresh Paillier key pair (OS randomness, never seeded), or the
    plaintext stand-in when ``encrypt`` is False."""
    if not encrypt:
        return PlainBackend(channel)
    from fedloom.secure.paillier import generate_keypair

    with channel.crypto():
        keypair = generate_keypair(key_bits)
    return PaillierBackend(
        channel,
        keypair=keypair,
        frac_bits=frac_bits,
        mask_random=mask_random,
        zero_masks=zero_masks,
    )


def public_view(key: HEBackend) -> HEBackend:
    """What the other parties hold of ``key``: its public half (the plaintext stand-in is
    shared as is)."""
    return key.public() if isinstance(key, PaillierBackend) else key


def public_key_payload(key: HEBackend) -> int:
    """The public key as sent on the wire (its modulus n; 0 in the plaintext path)."""
    return key.public_key.n if isinstance(key, PaillierBackend) else 0
