"""SecureBoost's gradient histograms: how the guest's g, h travel to a host, how the host sums
them per (feature, bucket), and how the sums come back (docs/vertical.md, steps
1-4, and SecureBoost+ (a)-(c), Chen et al. 2021, arXiv:2110.10927).

Three encodings, one interface:

- ``plain`` (the plaintext path): float g, h; float64 sums (``np.bincount``).
- ``paillier`` unpacked: [[round(g·2^p)]], [[round(h·2^p)]] as signed fixed-point integers
  under the guest's key (one common exponent: phe's per-value exponents made root histograms
  12x slower); each bucket sum travels as its own ciphertext.
- ``paillier`` packed (SecureBoost+ (a) and (b)): one plaintext per instance,
  m_i = round((g_i + g_off)·2^p)·2^{b_h} + round(h_i·2^p), b_h = p + ⌈log2 n⌉ + 1, so a bucket
  sum holds Σh in its low b_h bits and Σ(g + g_off) above; the host then compresses S bucket
  sums into one ciphertext (Σ_j [[M_j]] ⊗ 2^{j·w}, w the bits of one bucket sum: the slot
  layout of :class:`~fedloom.secure.paillier.SlotPacking`), sending bucket counts so the guest
  can remove count·g_off.

Every ciphertext a host sends is re-randomised: the guest knows the randomness of each [[g_i]]
it made, and a bare product of them could reveal which instances share a bucket.
Histogram subtraction (SecureBoost+ (c)): a host builds the smaller child and derives its
sibling as parent − child (homomorphically: c_parent · c_child^{-1}).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import reduce
from operator import add

import numpy as np
from phe.util import mulmod, powmod

from fedloom.secure.paillier import (
    Ciphertext,
    PrivateKey,
    PublicKey,
    SlotPacking,
    ciphertext_bytes,
    decrypt_ints,
    decrypt_packed,
    encrypt_ints,
    encrypt_packed,
    rerandomize,
    subtract_ciphertexts,
)

DEFAULT_GH_FRAC_BITS = 53
"""p: a float32 g or h keeps every bit it has above 2^-53."""


@dataclass(frozen=True)
class GHLayout:
    """The packed GH layout (SecureBoost+ (a)): public parameters only."""

    frac_bits: int
    h_bits: int
    slot_bits: int

    @classmethod
    def for_data(cls, n: int, frac_bits: int, g_offset: float, h_max: float = 1.0) -> GHLayout:
        """b_h = p + ⌈log2(n·h_max)⌉ + 1 bits hold Σh over n instances; a bucket sum needs
        b_h + p + ⌈log2(2·g_off·n)⌉ + 1 bits in all."""
        h_bits = frac_bits + math.ceil(math.log2(max(2.0, n * h_max))) + 1
        g_bits = frac_bits + math.ceil(math.log2(max(2.0, 2.0 * g_offset * n))) + 1
        return cls(frac_bits, h_bits, h_bits + g_bits)

    def pack(self, g: np.ndarray, h: np.ndarray, g_offset: float) -> list[int]:
        """m_i = round((g_i + g_off)·2^p)·2^{b_h} + round(h_i·2^p) (non-negative ints)."""
        scale = 2.0**self.frac_bits
        gq = np.rint((g.astype(np.float64) + g_offset) * scale)
        hq = np.rint(h.astype(np.float64) * scale)
        if gq.min() < 0 or hq.min() < 0:
            raise ValueError("g + g_offset and h must be non-negative to be packed")
        return [(int(a) << self.h_bits) + int(b) for a, b in zip(gq, hq, strict=True)]

    def unpack(
        self, sums: np.ndarray, counts: np.ndarray, g_offset: float
    ) -> tuple[np.ndarray, np.ndarray]:
        """(G, H) of bucket sums: H = M mod 2^{b_h}, G = (M >> b_h)/2^p − count·g_off."""
        flat = [int(m) for m in np.asarray(sums, dtype=object).ravel()]
        mask = (1 << self.h_bits) - 1
        denom = 1 << self.frac_bits
        h = np.array([(m & mask) / denom for m in flat])
        g = np.array([(m >> self.h_bits) / denom for m in flat])
        g = g - np.asarray(counts, dtype=np.float64).ravel() * g_offset
        return g.reshape(np.shape(sums)), h.reshape(np.shape(sums))


@dataclass(frozen=True, eq=False)
class EncryptedGradients:
    """Guest -> host, once per tree: the instances' g, h in one of the three encodings."""

    kind: str  # "plain" | "separate" | "packed"
    channels: dict[str, np.ndarray | list[Ciphertext]]
    public_key: PublicKey | None = None
    layout: GHLayout | None = None
    frac_bits: int = DEFAULT_GH_FRAC_BITS

    @property
    def nbytes(self) -> int:
        if self.kind == "plain":
            return sum(int(np.asarray(v).nbytes) for v in self.channels.values())
        assert self.public_key is not None
        return sum(len(v) for v in self.channels.values()) * ciphertext_bytes(self.public_key)


@dataclass(frozen=True, eq=False)
class HistogramPayload:
    """Host -> guest: one node's bucket sums over opaque feature ids (features × bins), as
    plain arrays, ciphertexts, or compressed ciphertexts of ``slots`` bucket sums each; bucket
    counts travel only with the packed encoding."""

    kind: str
    shape: tuple[int, int]
    channels: dict[str, np.ndarray | list[Ciphertext]]
    counts: np.ndarray | None = None
    slots: int = 1
    ct_bytes: int = 0
    missing: np.ndarray | None = None
    """Per opaque feature: whether some instance of the node lacks it (one bit each)."""

    @property
    def nbytes(self) -> int:
        total = 0 if self.counts is None else int(self.counts.astype(np.int32).nbytes)
        total += 0 if self.missing is None else int(np.packbits(self.missing).nbytes)
        for v in self.channels.values():
            total += int(np.asarray(v).nbytes) if self.kind == "plain" else len(v) * self.ct_bytes
        return total


@dataclass
class HostHistogram:
    """A node's sums per (feature, bucket) in the host's own feature order, over the
    instances that have the feature (``rows``: the node's instances, missing ones included)."""

    channels: dict[str, np.ndarray]
    counts: np.ndarray
    rows: int = 0

    @property
    def missing(self) -> np.ndarray:
        """Per feature: whether some instance of the node lacks it."""
        return self.counts.sum(axis=1) < self.rows


class HistogramKernel:
    """The host's side: bucket sums of what the guest sent, subtraction, and export."""

    def __init__(self, gradients: EncryptedGradients, compress: bool = True) -> None:
        self.kind = gradients.kind
        self.channels = gradients.channels
        self.public_key = gradients.public_key
        self.layout = gradients.layout
        self.compress = compress

    def build(self, bins: np.ndarray, ids: np.ndarray, n_bins: int) -> HostHistogram:
        """Bucket sums over the instances ``ids`` (bins: the host's n × features matrix; a
        missing entry's bin, ``n_bins``, is left out)."""
        n_features = bins.shape[1]
        counts = np.zeros((n_features, n_bins), dtype=np.int64)
        sub = bins[ids]
        for k in range(n_features):
            counts[k] = np.bincount(sub[:, k], minlength=n_bins + 1)[:n_bins]
        if self.kind == "plain":
            out = {}
            for name, values in self.channels.items():
                w = np.asarray(values, dtype=np.float64)[ids]
                out[name] = np.stack(
                    [
                        np.bincount(sub[:, k], weights=w, minlength=n_bins + 1)[:n_bins]
                        for k in range(n_features)
                    ]
                )
            return HostHistogram(out, counts, len(ids))
        assert self.public_key is not None
        zero = Ciphertext(self.public_key, 1, 0)  # [[0]] with r = 1, re-randomised on export
        out = {}
        for name, cts in self.channels.items():
            table = np.empty((n_features, n_bins), dtype=object)
            table.fill(zero)
            for k in range(n_features):
                order = np.argsort(sub[:, k], kind="stable")
                col = sub[order, k]
                bounds = np.searchsorted(col, np.arange(n_bins + 1))
                for b in range(n_bins):
                    lo, hi = bounds[b], bounds[b + 1]
                    if hi > lo:
                        table[k, b] = reduce(add, (cts[i] for i in ids[order[lo:hi]]))
            out[name] = table
        return HostHistogram(out, counts, len(ids))

    def subtract(self, parent: HostHistogram, child: HostHistogram) -> HostHistogram:
        """The sibling's histogram: parent − child."""
        counts = parent.counts - child.counts
        rows = parent.rows - child.rows
        if self.kind == "plain":
            return HostHistogram(
                {k: parent.channels[k] - child.channels[k] for k in parent.channels}, counts, rows
            )
        out = {}
        for name, table in parent.channels.items():
            diff = subtract_ciphertexts(list(table.ravel()), list(child.channels[name].ravel()))
            arr = np.empty(len(diff), dtype=object)
            arr[:] = diff
            out[name] = arr.reshape(table.shape)
        return HostHistogram(out, counts, rows)

    def export(self, hist: HostHistogram, perm: np.ndarray) -> HistogramPayload:
        """The histogram with features in the opaque order ``perm`` (row j is feature
        perm[j]), compressed and re-randomised when encrypted."""
        shape = (len(perm), hist.counts.shape[1])
        missing = hist.missing[perm]
        if self.kind == "plain":
            chans = {k: v[perm] for k, v in hist.channels.items()}
            return HistogramPayload("plain", shape, chans, missing=missing)
        assert self.public_key is not None
        ct_bytes = ciphertext_bytes(self.public_key)
        if self.kind == "separate":
            chans = {k: rerandomize(v[perm].ravel()) for k, v in hist.channels.items()}
            return HistogramPayload("separate", shape, chans, ct_bytes=ct_bytes, missing=missing)
        assert self.layout is not None
        flat = list(hist.channels["gh"][perm].ravel())
        counts = hist.counts[perm]
        if not self.compress:
            return HistogramPayload(
                "packed", shape, {"gh": rerandomize(flat)}, counts, 1, ct_bytes, missing
            )
        packing = SlotPacking.for_key(self.public_key.n.bit_length(), self.layout.slot_bits)
        compressed = [
            compress(flat[i : i + packing.slots], packing.slot_bits)
            for i in range(0, len(flat), packing.slots)
        ]
        return HistogramPayload(
            "packed",
            shape,
            {"gh": rerandomize(compressed)},
            counts,
            packing.slots,
            ct_bytes,
            missing,
        )


def compress(cts: list[Ciphertext], slot_bits: int) -> Ciphertext:
    """Σ_j [[M_j]] ⊗ 2^{j·w} by Horner's rule (slot j at bits [j·w, (j+1)·w): SlotPacking's
    little-endian layout)."""
    public_key = cts[0].public_key
    nsquare = public_key.nsquare
    shift = 1 << slot_bits
    acc = cts[-1].ciphertext(be_secure=False)
    for c in reversed(cts[:-1]):
        acc = mulmod(powmod(acc, shift, nsquare), c.ciphertext(be_secure=False), nsquare)
    return Ciphertext(public_key, int(acc), 0)


def encode_gradients(
    kind: str,
    g: np.ndarray,
    h: np.ndarray,
    *,
    public_key: PublicKey | None = None,
    frac_bits: int = DEFAULT_GH_FRAC_BITS,
    g_offset: float = 1.0,
) -> EncryptedGradients:
    """The guest's message of g, h (float32 arrays) in encoding ``kind``."""
    if kind == "plain":
        return EncryptedGradients("plain", {"g": g.copy(), "h": h.copy()})
    assert public_key is not None
    if kind == "separate":
        scale = 2.0**frac_bits
        chans = {
            name: encrypt_ints(
                public_key, (int(v) for v in np.rint(arr.astype(np.float64) * scale))
            )
            for name, arr in (("g", g), ("h", h))
        }
        return EncryptedGradients("separate", chans, public_key, frac_bits=frac_bits)
    layout = GHLayout.for_data(len(g), frac_bits, g_offset)
    packed = encrypt_packed(public_key, layout.pack(g, h, g_offset))
    return EncryptedGradients("packed", {"gh": packed}, public_key, layout, frac_bits)


def decode_histogram(
    payload: HistogramPayload,
    private_key: PrivateKey | None = None,
    *,
    frac_bits: int = DEFAULT_GH_FRAC_BITS,
    layout: GHLayout | None = None,
    g_offset: float = 1.0,
) -> tuple[np.ndarray, np.ndarray]:
    """The guest's side: (G, H) float64 arrays (features × bins) of a host's payload."""
    if payload.kind == "plain":
        return payload.channels["g"], payload.channels["h"]  # type: ignore[return-value]
    assert private_key is not None
    if payload.kind == "separate":
        denom = 1 << frac_bits
        out = []
        for name in ("g", "h"):
            ints = decrypt_ints(private_key, payload.channels[name])
            out.append(np.array([v / denom for v in ints]).reshape(payload.shape))
        return out[0], out[1]
    assert layout is not None and payload.counts is not None
    plain = decrypt_packed(private_key, payload.channels["gh"])
    size = payload.shape[0] * payload.shape[1]
    if payload.slots == 1:
        sums = np.array(plain, dtype=object)
    else:
        sums = SlotPacking(layout.slot_bits, payload.slots).unpack(plain, size)
    return layout.unpack(
        np.asarray(sums, dtype=object).reshape(payload.shape), payload.counts, g_offset
    )
