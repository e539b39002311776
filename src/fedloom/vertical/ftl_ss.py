"""Federated transfer learning with additive secret sharing and Beaver triples (Liu et al.,
arXiv:1812.03337, Section 5.2; docs/vertical.md, secret-sharing variant).

Values are fixed-point in Z_{2^64} (f = 20 fractional bits) and additively shared,
x = ⟨x⟩_0 + ⟨x⟩_1 (party 0 = source A, party 1 = target B); a private input enters as the
trivial sharing (x, 0). Every cross term of the FTL gradient and loss is a product of an
A-private and a B-private (or shared) quantity, computed with a dealer's triple (U, V, W = UV):
both open E = X − U and F = Y − V; ⟨Z⟩_0 = EF + E⟨V⟩_0 + ⟨U⟩_0F + ⟨W⟩_0,
⟨Z⟩_1 = E⟨V⟩_1 + ⟨U⟩_1F + ⟨W⟩_1; then local truncation (party 0: floor(z/2^f) of the signed
value, party 1: −floor(−z/2^f)), exact up to one unit in the last place with probability
1 − 2^{bits(|z|)+1−64}. Triples are single-use (reusing one with X' would open X − X'):
:class:`BeaverTriple` raises :class:`TripleReuseError`. Gradient shares are reconstructed
only by their owner; the loss by both. The dealer is an offline role (a trusted simulation;
in deployment an AHE- or OT-based preprocessing); its and all sharing randomness come from the
run's seeded streams, which is a simulation shortcut (a deployment draws them from a CSPRNG).

Per iteration (A: U_A, Φ, y; B: U_B): φ = U_Bc Φᵀ; c = (−½y_c + ¼φ)/N_c;
∂W_B = X_Bcᵀ((cΦ) ∘ D_Bc) + X_Boᵀ((2γ/N_AB)(U_Bo − U_Ao) ∘ D_Bo);
∂W_A = (X_Aᵀ(D_A ∘ y/N_A)) ∘ (cᵀU_Bc) + X_Aoᵀ((2γ/N_AB)(U_Ao − U_Bo) ∘ D_Ao), D = 1 − U².
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from fedloom.core.rng import numpy_rng
from fedloom.vertical.ftl_model import Alignment, FTLParams, phi_source, represent
from fedloom.vertical.messages import PREDICT, Channel, Party

RING = np.uint64
SS_FRAC_BITS = 20
PUBLIC_WEIGHT_BITS = 17
"""A public constant c multiplies a share as k = round(c·2^b) with 2^17 <= |k| < 2^18 (relative
precision ~2^-18), then truncation by b: small enough that the product stays far from 2^63."""
L2_PRESCALE = 1.0 / 8
"""The L_2 part of a gradient is summed over the overlap at 1/32 of its size, then rescaled:
keeps x^T(...) sums below ~2^5 (truncation safety) at a small cost in precision."""


class TripleReuseError(RuntimeError):
    """A Beaver triple was consumed twice: reusing it would open X − X'."""


def encode(x: np.ndarray, frac_bits: int) -> np.ndarray:
    """round(x·2^f) in Z_{2^64} (two's complement)."""
    return np.rint(np.asarray(x, dtype=np.float64) * 2.0**frac_bits).astype(np.int64).view(RING)


def decode(v: np.ndarray, frac_bits: int) -> np.ndarray:
    return np.asarray(v, dtype=RING).view(np.int64) / 2.0**frac_bits


def truncate(share: np.ndarray, party: int, bits: int) -> np.ndarray:
    """SecureML's local truncation of one party's share by ``bits``."""
    signed = np.asarray(share, dtype=RING).view(np.int64)
    if party == 0:
        return (signed >> bits).view(RING)
    neg = (np.zeros_like(share, dtype=RING) - share).view(np.int64)
    return (-(neg >> bits)).view(RING)


@dataclass
class Shared:
    """A shared array: ``shares[0]`` is held by party 0 (A), ``shares[1]`` by party 1 (B)."""

    shares: tuple[np.ndarray, np.ndarray]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.shares[0].shape

    def map(self, fn: Callable[[np.ndarray], np.ndarray]) -> Shared:
        """A local, linear operation applied by each party to its own share."""
        return Shared((fn(self.shares[0]), fn(self.shares[1])))

    def __add__(self, other: Shared) -> Shared:
        return Shared((self.shares[0] + other.shares[0], self.shares[1] + other.shares[1]))

    def __sub__(self, other: Shared) -> Shared:
        return Shared((self.shares[0] - other.shares[0], self.shares[1] - other.shares[1]))

    @property
    def T(self) -> Shared:
        return self.map(np.transpose)


@dataclass
class BeaverTriple:
    """(U, V, W = U∘V or UV), each additively shared; single use."""

    u: tuple[np.ndarray, np.ndarray]
    v: tuple[np.ndarray, np.ndarray]
    w: tuple[np.ndarray, np.ndarray]
    used: bool = False

    def consume(self) -> BeaverTriple:
        if self.used:
            raise TripleReuseError("this Beaver triple was used already: triples are single-use")
        self.used = True
        return self


class SSParty(Party):
    """A party of the secret-sharing protocol: its features, its layer W, its share slot."""

    def __init__(
        self,
        name: str,
        channel: Channel,
        index: int,
        x: np.ndarray,
        w: np.ndarray,
        y: np.ndarray | None = None,
    ) -> None:
        super().__init__(name, channel)
        self.index, self.x, self.w, self.y = index, x, w.copy(), y
        self.last_gradient: np.ndarray | None = None


class Dealer(Party):
    """The offline role that hands out triples (seeded stream: a simulation)."""

    def __init__(self, name: str, channel: Channel, seed: int) -> None:
        super().__init__(name, channel)
        self.rng = numpy_rng(seed, "ftl_ss_dealer")

    def _split(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        r = self.rng.integers(0, 2**64, size=x.shape, dtype=RING)
        return r, x - r

    def triple(
        self, shape_x: tuple[int, ...], shape_y: tuple[int, ...], matmul: bool, parties: list[Party]
    ) -> BeaverTriple:
        u = self.rng.integers(0, 2**64, size=shape_x, dtype=RING)
        v = self.rng.integers(0, 2**64, size=shape_y, dtype=RING)
        w = u @ v if matmul else u * v
        t = BeaverTriple(self._split(u), self._split(v), self._split(w))
        for i, p in enumerate(parties):
            self.send(p, "triple", t.u[i], t.v[i], t.w[i], stage="offline")
        return t


class SSEngine:
    """Arithmetic on shares between parties 0 and 1, every opening sent as a message."""

    def __init__(self, parties: list[SSParty], dealer: Dealer, frac_bits: int = SS_FRAC_BITS):
        self.parties, self.dealer, self.f = parties, dealer, frac_bits
        self.channel = dealer.channel

    def private(self, owner: int, x: np.ndarray) -> Shared:
        """Owner's private input as the trivial sharing (x, 0): no message needed."""
        enc = encode(x, self.f)
        zero = np.zeros_like(enc)
        return Shared((enc, zero) if owner == 0 else (zero, enc))

    def add_private(self, a: Shared, owner: int, x: np.ndarray) -> Shared:
        enc = np.broadcast_to(encode(x, self.f), a.shape)
        s = list(a.shares)
        s[owner] = s[owner] + enc
        return Shared((s[0], s[1]))

    def mul_public(self, a: Shared, c: float) -> Shared:
        """a·c for a public real c: k = round(c·2^b) with |k| in [2^17, 2^18), each share
        times k, then truncated by b."""
        if c == 0:
            return a.map(np.zeros_like)
        bits = PUBLIC_WEIGHT_BITS - math.floor(math.log2(abs(c)))
        k = np.array(round(c * 2.0**bits), dtype=np.int64).view(RING)
        return Shared((truncate(a.shares[0] * k, 0, bits), truncate(a.shares[1] * k, 1, bits)))

    def multiply(self, x: Shared, y: Shared, matmul: bool, stage: str) -> Shared:
        """X @ Y (``matmul``) or X ∘ Y with a fresh triple; one round of openings."""
        p0, p1 = self.parties
        with self.channel.crypto():
            t = self.dealer.triple(x.shape, y.shape, matmul, [p0, p1]).consume()
            e_parts = [x.shares[i] - t.u[i] for i in (0, 1)]
            f_parts = [y.shares[i] - t.v[i] for i in (0, 1)]
        p0.send(p1, "beaver_open", e_parts[0], f_parts[0], stage=stage)
        p1.send(p0, "beaver_open", e_parts[1], f_parts[1], stage=stage)
        with self.channel.crypto():
            e, f = e_parts[0] + e_parts[1], f_parts[0] + f_parts[1]
            op = np.matmul if matmul else np.multiply
            z0 = op(e, f) + op(e, t.v[0]) + op(t.u[0], f) + t.w[0]
            z1 = op(e, t.v[1]) + op(t.u[1], f) + t.w[1]
            return Shared((truncate(z0, 0, self.f), truncate(z1, 1, self.f)))

    def reveal(self, a: Shared, to: int | None, stage: str) -> np.ndarray:
        """The value, sent to party ``to`` by the other (or to both when None)."""
        p0, p1 = self.parties
        if to in (0, None):
            p1.send(p0, "share", a.shares[1], stage=stage)
        if to in (1, None):
            p0.send(p1, "share", a.shares[0], stage=stage)
        return decode(a.shares[0] + a.shares[1], self.f)


class SSProtocol:
    """FTL's iteration and prediction on shares (module docstring)."""

    def __init__(
        self,
        channel: Channel,
        x_a: np.ndarray,
        y: np.ndarray,
        x_b: np.ndarray,
        w_a: np.ndarray,
        w_b: np.ndarray,
        align: Alignment,
        params: FTLParams,
        lr: float,
        *,
        frac_bits: int = SS_FRAC_BITS,
        seed: int = 0,
    ) -> None:
        self.a = SSParty("source", channel, 0, x_a, w_a, y)
        self.b = SSParty("target", channel, 1, x_b, w_b)
        self.ss = SSEngine([self.a, self.b], Dealer("dealer", channel, seed), frac_bits)
        self.align, self.params, self.lr = align, params, lr

    def iteration(self) -> float:
        ss, al, p = self.ss, self.align, self.params
        y = self.a.y
        assert y is not None
        u_a, u_b = represent(self.a.x, self.a.w), represent(self.b.x, self.b.w)
        phi = phi_source(u_a, y)
        n_a, n_ab, n_c = len(y), len(al.overlap_a), len(al.labelled)
        y_c = y[al.labelled_a]
        ub_c, ub_o, ua_o = u_b[al.labelled_b], u_b[al.overlap_b], u_a[al.overlap_a]
        phi_a = ss.private(0, phi[:, None])
        # Magnitudes: every shared value is kept within ~2^5 (truncation fails with probability
        # ~|z|/2^63 per entry, z the product at scale 2^2f) and away from 2^-f (precision).
        # φ = U_Bc Φᵀ and c = (−½ y_c + ¼ φ)/N_c
        f = ss.multiply(ss.private(1, ub_c), phi_a, True, "phi")
        root = math.sqrt(n_c)  # c is shared at √N_c times its size, divided out at the end
        c = ss.add_private(ss.mul_public(f, 0.25 / root), 0, (-0.5 * y_c / root)[:, None])
        # B: ∂W_B = X_Bcᵀ((cΦ) ∘ D_Bc) + (2γ/N_AB) X_Boᵀ((U_Bo − U_Ao) ∘ D_Bo)
        g1_b = ss.multiply(c, ss.private(0, phi[None, :]), True, "gradient_target")
        diff_b = ss.private(1, ub_o) - ss.private(0, ua_o)
        l2 = 2 * p.gamma / n_ab
        grad_b = self._push(1, self.b.x[al.labelled_b], ub_c, g1_b, 1 / root, "gradient_target")
        grad_b = grad_b + self._push(
            1, self.b.x[al.overlap_b], ub_o, diff_b, l2, "gradient_target", L2_PRESCALE
        )
        # A: ∂W_A = (X_Aᵀ(D_A ∘ y/N_A)) ∘ (cᵀU_Bc) + (2γ/N_AB) X_Aoᵀ((U_Ao − U_Bo) ∘ D_Ao)
        v = ss.multiply(c.T, ss.private(1, ub_c), True, "gradient_source")  # (1, d)
        weights = self.a.x.T @ ((1.0 - u_a**2) * (y / n_a)[:, None])
        grad_a = ss.mul_public(
            ss.multiply(
                ss.private(0, weights),
                v.map(lambda s: np.repeat(s, weights.shape[0], axis=0)),
                False,
                "gradient_source",
            ),
            1 / root,
        )
        diff_a = diff_b.map(np.negative)
        grad_a = grad_a + self._push(
            0, self.a.x[al.overlap_a], ua_o, diff_a, l2, "gradient_source", L2_PRESCALE
        )
        # loss, revealed to both
        loss = self._loss(f, y_c, ua_o, ub_o, n_c, n_ab)
        ga = ss.reveal(grad_a, 0, "gradient_source")
        gb = ss.reveal(grad_b, 1, "gradient_target")
        for party, g in ((self.a, ga), (self.b, gb)):
            party.last_gradient = g + p.reg_lambda * party.w
            party.w = party.w - self.lr * party.last_gradient
        return loss

    def _push(
        self,
        owner: int,
        x: np.ndarray,
        u: np.ndarray,
        grad_u: Shared,
        scale: float,
        stage: str,
        prescale: float = 1.0,
    ) -> Shared:
        """[scale · xᵀ(∂L/∂u ∘ (1 − u²))] with the owner's x and u: one Hadamard product, one
        matrix product (summed at ``prescale`` times its size, rescaled after the sum)."""
        ss = self.ss
        h = ss.multiply(grad_u, ss.private(owner, 1.0 - u**2), False, stage)
        if prescale != 1.0:
            h = ss.mul_public(h, prescale)
        return ss.mul_public(ss.multiply(ss.private(owner, x.T), h, True, stage), scale / prescale)

    def _loss(
        self, f: Shared, y_c: np.ndarray, ua_o: np.ndarray, ub_o: np.ndarray, n_c: int, n_ab: int
    ) -> float:
        ss, p = self.ss, self.params
        yf = ss.multiply(ss.private(0, y_c[:, None]), f, False, "loss")  # f: φ
        ff = ss.multiply(f, f, False, "loss")
        cross = ss.multiply(ss.private(0, ua_o), ss.private(1, ub_o), False, "loss")
        total = (
            ss.mul_public(yf.map(lambda s: s.sum(keepdims=True)), -0.5 / n_c)
            + ss.mul_public(ff.map(lambda s: s.sum(keepdims=True)), 0.125 / n_c)
            + ss.mul_public(
                cross.map(lambda s: s.sum(keepdims=True).reshape(1, 1)), -2 * p.gamma / n_ab
            )
        )
        own_a = math.log(2.0) + p.gamma * float(np.sum(ua_o**2)) / n_ab
        own_a += 0.5 * p.reg_lambda * float(np.sum(self.a.w**2))
        own_b = p.gamma * float(np.sum(ub_o**2)) / n_ab + 0.5 * p.reg_lambda * float(
            np.sum(self.b.w**2)
        )
        total = ss.add_private(
            ss.add_private(total, 0, np.array([[own_a]])), 1, np.array([[own_b]])
        )
        return float(ss.reveal(total, None, "loss")[0, 0])

    def predict(self, x_b: np.ndarray) -> np.ndarray:
        """φ of new target rows, revealed to B only."""
        assert self.a.y is not None
        phi = phi_source(represent(self.a.x, self.a.w), self.a.y)
        scores = self.ss.multiply(
            self.ss.private(1, represent(x_b, self.b.w)),
            self.ss.private(0, phi[:, None]),
            True,
            PREDICT,
        )
        return self.ss.reveal(scores, 1, PREDICT)[:, 0]
