"""Federated transfer learning with additively homomorphic encryption and two key pairs, no
third party (Liu et al., arXiv:1812.03337, Section 5; docs/vertical.md, AHE protocol).

One iteration ([[·]]_A under A's key, [[·]]_B under B's; the public factors 1/N_c, γ/N_AB are
folded in by whoever encrypts):
  1. A → B: [[−½ y_i Φ^A/N_c]]_A (i ∈ D_c), [[¼ Φ^AᵀΦ^A/N_c]]_A (d×d), [[γκ u_i^A/N_AB]]_A (D_AB).
  2. B → A: [[u_i^B]]_B (D_c), [[Σ_{D_c} u_i^Bᵀu_i^B]]_B (d×d), [[γκ u_i^B/N_AB]]_B (D_AB),
     [[(γ/N_AB) Σ‖u_i^B‖² + λ/2 ‖W_B‖²]]_B.
  3. B: [[∂L/∂u_i^B]]_A = [[−½y_iΦ/N_c]] ⊕ u_i^B ⊗ [[¼ΦᵀΦ/N_c]] (D_c) and
     [[γκu_i^A/N_AB]] ⊕ (2γ/N_AB) u_i^B (D_AB), pushed through its Jacobian to [[∂L/∂W_B]]_A;
     adds [[m_B]]_A; A decrypts and returns; B unmasks, adds λW_B, steps.
  4. A: [[v]]_B = Σ_i (−½ y_i/N_c) [[u_i^B]] ⊕ (¼Φ/N_c) ⊗ [[Σ u^Bᵀu^B]], so that
     ∂L_1/∂W_A[p, j] = (Σ_k x_kp (1 − u_kj²) y_k/N_A) ⊗ [[v_j]]; plus [[γκu_k^B/N_AB]] ⊕
     (2γ/N_AB)u_k^A (D_AB) through its Jacobian; masked, decrypted by B, unmasked by A.
  5. A assembles [[L]]_B from the step-2 ciphertexts; B decrypts it and shares L.
Parameter-level gradients only: the representation-level ones (∂L/∂u, all colinear with Φ^A and
carrying −½y_i + ¼φ_i, i.e. the labels; and κu^B for A) are decrypted only with
``leaky_fast=True``, where each party then backpropagates in the clear.
"""

from __future__ import annotations

import math

import numpy as np

from fedloom.vertical.ftl_model import (
    KAPPA,
    Alignment,
    FTLParams,
    backprop,
    jacobian_weights,
    phi_source,
    represent,
)
from fedloom.vertical.he import (
    EncryptedArray,
    HEBackend,
    Mask,
    MaskedValues,
    public_key_payload,
    public_view,
)
from fedloom.vertical.messages import PREDICT, Channel, Message, Party


class FTLParty(Party):
    """A party's network (one tanh layer), its own key (decrypts) and the other's public key."""

    def __init__(
        self, name: str, channel: Channel, x: np.ndarray, w: np.ndarray, key: HEBackend, lr: float
    ) -> None:
        super().__init__(name, channel)
        self.x, self.w, self.key, self.lr = x, w.copy(), key, lr
        self.other: HEBackend | None = None
        self.last_gradient: np.ndarray | None = None

    def push(self, backend: HEBackend, rows: np.ndarray, grad_u: EncryptedArray) -> EncryptedArray:
        """[[∂L/∂W]] = xᵀ([[∂L/∂u]] ∘ (1 − u²)) over ``rows``: per column j, P_j ⊗ [[g_:j]]."""
        x = self.x[rows]
        u = represent(x, self.w)
        cols = [
            backend.matmul_plain(p_j, backend.take(grad_u, j, axis=1))
            for j, p_j in enumerate(jacobian_weights(x, u))
        ]
        return backend.stack(cols, axis=1)

    def masked(self, grad: EncryptedArray) -> tuple[EncryptedArray, Mask | None]:
        """[[g + m]] under the other party's key, and m (kept)."""
        assert self.other is not None
        return self.other.mask(grad)

    def decrypt_masked(self, masked: EncryptedArray) -> MaskedValues:
        """Decrypt the other party's masked gradient (sees g + m only)."""
        return self.key.decrypt_masked(masked)

    def step(self, grad: np.ndarray, reg_lambda: float) -> None:
        full = grad + reg_lambda * self.w
        self.last_gradient = full
        self.w = self.w - self.lr * full


class SourceParty(FTLParty):
    """A: features, labels y ∈ {−1, +1}, Φ^A."""

    def __init__(
        self,
        name: str,
        channel: Channel,
        x: np.ndarray,
        w: np.ndarray,
        key: HEBackend,
        lr: float,
        *,
        y: np.ndarray,
        align: Alignment,
        params: FTLParams,
    ) -> None:
        super().__init__(name, channel, x, w, key, lr)
        self.y, self.align, self.params = y, align, params

    def terms(self) -> tuple[EncryptedArray, EncryptedArray, EncryptedArray]:
        """Step 1, under A's own key."""
        al, p = self.align, self.params
        u = represent(self.x, self.w)
        phi = phi_source(u, self.y)
        n_c, n_ab = len(al.labelled), len(al.overlap_a)
        y_c = self.y[al.labelled_a]
        return (
            self.key.encrypt(-0.5 * y_c[:, None] * phi[None, :] / n_c),
            self.key.encrypt(0.25 * np.outer(phi, phi) / n_c),
            self.key.encrypt(p.gamma * KAPPA * u[al.overlap_a] / n_ab),
        )

    def gradient(
        self, ub_c: EncryptedArray, k_ub: EncryptedArray, s_b: EncryptedArray
    ) -> tuple[EncryptedArray, EncryptedArray, EncryptedArray]:
        """Step 4 under B's key: [[∂L/∂W_A]]_B (without λW_A), and the representation-level
        pieces [[v]] and [[∂L_2/∂u^A]] (decrypted only in the leaky mode)."""
        assert self.other is not None
        be, al, p = self.other, self.align, self.params
        u = represent(self.x, self.w)
        phi = phi_source(u, self.y)
        n_c, n_ab, n_a = len(al.labelled), len(al.overlap_a), len(self.y)
        y_c = self.y[al.labelled_a]
        v = be.add(
            be.matmul_plain((-0.5 * y_c / n_c)[None, :], ub_c),
            be.matmul_plain((0.25 * phi / n_c)[None, :], s_b),
        )  # (1, d)
        weights = self.x.T @ ((1.0 - u**2) * (self.y / n_a)[:, None])  # (p, d)
        g1 = be.mul_plain(v, weights)
        ua_o = u[al.overlap_a]
        g2_u = be.add_plain(k_ub, 2 * p.gamma / n_ab * ua_o)
        return be.add(g1, self.push(be, al.overlap_a, g2_u)), v, g2_u

    def loss(
        self, ub_c: EncryptedArray, s_b: EncryptedArray, k_ub: EncryptedArray, own_b: EncryptedArray
    ) -> EncryptedArray:
        """Step 5: [[L]]_B from B's step-2 ciphertexts, re-randomised."""
        assert self.other is not None
        be, al, p = self.other, self.align, self.params
        u = represent(self.x, self.w)
        phi = phi_source(u, self.y)
        n_c, n_ab = len(al.labelled), len(al.overlap_a)
        y_c = self.y[al.labelled_a]
        sum_y_u = be.matmul_plain(y_c[None, :], ub_c)  # Σ y_i u_i^B, (1, d)
        t1 = be.rmatmul_plain(sum_y_u, (-0.5 * phi / n_c)[:, None])
        t2 = be.rmatmul_plain(be.matmul_plain(phi[None, :], s_b), (0.125 * phi / n_c)[:, None])
        cross = be.sum(be.mul_plain(k_ub, u[al.overlap_a]))
        ua_o = u[al.overlap_a]
        own = math.log(2.0) + p.gamma * float(np.sum(ua_o**2)) / n_ab
        own += 0.5 * p.reg_lambda * float(np.sum(self.w**2))
        total = be.add_many(be.sum(t1), be.sum(t2), cross, be.sum(own_b))
        return be.rerandomize(be.add_plain(total, np.array(own)))

    def scores(self, u_b: EncryptedArray) -> EncryptedArray:
        """Prediction: [[φ_j]]_B = [[u_j^B]] @ Φ^A, re-randomised."""
        assert self.other is not None
        phi = phi_source(represent(self.x, self.w), self.y)
        return self.other.rerandomize(self.other.rmatmul_plain(u_b, phi[:, None]))


class TargetParty(FTLParty):
    """B: features only."""

    def __init__(
        self,
        name: str,
        channel: Channel,
        x: np.ndarray,
        w: np.ndarray,
        key: HEBackend,
        lr: float,
        *,
        align: Alignment,
        params: FTLParams,
    ) -> None:
        super().__init__(name, channel, x, w, key, lr)
        self.align, self.params = align, params

    def terms(self) -> tuple[EncryptedArray, EncryptedArray, EncryptedArray, EncryptedArray]:
        """Step 2, under B's own key."""
        al, p = self.align, self.params
        u = represent(self.x, self.w)
        ub_c, ub_o = u[al.labelled_b], u[al.overlap_b]
        n_ab = len(al.overlap_b)
        own = p.gamma * float(np.sum(ub_o**2)) / n_ab + 0.5 * p.reg_lambda * float(
            np.sum(self.w**2)
        )
        return (
            self.key.encrypt(ub_c),
            self.key.encrypt(ub_c.T @ ub_c),
            self.key.encrypt(p.gamma * KAPPA * ub_o / n_ab),
            self.key.encrypt(np.array([own])),
        )

    def gradient_u(
        self, phi_y: EncryptedArray, phi_phi: EncryptedArray, k_ua: EncryptedArray
    ) -> tuple[EncryptedArray, EncryptedArray]:
        """Step 3 under A's key: [[∂L_1/∂u^B]] on D_c and [[∂L_2/∂u^B]] on D_AB."""
        assert self.other is not None
        be, al, p = self.other, self.align, self.params
        u = represent(self.x, self.w)
        g1 = be.add(phi_y, be.matmul_plain(u[al.labelled_b], phi_phi))
        g2 = be.add_plain(k_ua, 2 * p.gamma / len(al.overlap_b) * u[al.overlap_b])
        return g1, g2

    def gradient(self, g1: EncryptedArray, g2: EncryptedArray) -> EncryptedArray:
        assert self.other is not None
        be, al = self.other, self.align
        return be.add(self.push(be, al.labelled_b, g1), self.push(be, al.overlap_b, g2))


class AHEProtocol:
    """The iteration and prediction message flows (module docstring)."""

    def __init__(self, a: SourceParty, b: TargetParty, leaky_fast: bool = False) -> None:
        self.a, self.b, self.leaky_fast = a, b, leaky_fast
        a.other, b.other = public_view(b.key), public_view(a.key)
        for owner, other in ((a, b), (b, a)):
            n = public_key_payload(owner.key)
            if n:
                owner.send(other, "public_key", n, stage="setup")

    def iteration(self) -> float:
        a, b = self.a, self.b
        m1 = a.send(b, "source_terms", *a.terms(), stage="terms")
        m2 = b.send(a, "target_terms", *b.terms(), stage="terms")
        g1_b, g2_b = b.gradient_u(m1[0], m1[1], m1[2])
        if self.leaky_fast:
            grad_a, grad_b = self._leaky(m2, g1_b, g2_b)
        else:
            grad_b = self._exchange(b, a, b.gradient(g1_b, g2_b), "gradient")
            grad_a = self._exchange(a, b, a.gradient(m2[0], m2[2], m2[1])[0], "gradient")
        enc_loss = a.loss(m2[0], m2[1], m2[2], m2[3])
        m5 = a.send(b, "loss", enc_loss, stage="loss")
        value = float(b.key.decrypt(m5[0]))
        b.send(a, "loss_value", value, stage="loss")
        a.step(grad_a, a.params.reg_lambda)
        b.step(grad_b, b.params.reg_lambda)
        return value

    @staticmethod
    def _exchange(
        owner: FTLParty, holder: FTLParty, grad: EncryptedArray, stage: str
    ) -> np.ndarray:
        """owner -> holder: [[g + m]] under holder's key; holder decrypts and returns g + m;
        owner removes m."""
        masked, mask = owner.masked(grad)
        m = owner.send(holder, "masked_" + stage, masked, stage=stage)
        back = holder.send(
            owner, "masked_" + stage + "_plain", holder.decrypt_masked(m[0]), stage=stage
        )
        assert owner.other is not None
        return owner.other.unmask(back[0], mask)

    def _leaky(
        self, m2: Message, g1_b: EncryptedArray, g2_b: EncryptedArray
    ) -> tuple[np.ndarray, np.ndarray]:
        """``leaky_fast``: decrypt the representation-level gradients and backpropagate in the
        clear (B learns label information, A learns u^B on the overlap)."""
        a, b = self.a, self.b
        al = a.align
        g1 = self._exchange(b, a, g1_b, "u_gradient")
        g2 = self._exchange(b, a, g2_b, "u_gradient")
        u_b = represent(b.x, b.w)
        g_ub = np.zeros_like(u_b)
        np.add.at(g_ub, al.labelled_b, g1)
        np.add.at(g_ub, al.overlap_b, g2)
        _, v_enc, g2a_enc = a.gradient(m2[0], m2[2], m2[1])
        v = self._exchange(a, b, v_enc, "u_gradient")
        g2a = self._exchange(a, b, g2a_enc, "u_gradient")
        u_a = represent(a.x, a.w)
        g_ua = (a.y / len(a.y))[:, None] * v
        np.add.at(g_ua, al.overlap_a, g2a)
        return backprop(a.x, u_a, g_ua), backprop(b.x, u_b, g_ub)

    def predict(self, x_b: np.ndarray) -> np.ndarray:
        """φ of new target rows: B -> A [[u^B]]_B, A -> B [[u^B Φ^A]]_B, B decrypts."""
        a, b = self.a, self.b
        m = b.send(a, "target_representation", b.key.encrypt(represent(x_b, b.w)), stage=PREDICT)
        back = a.send(b, "scores", a.scores(m[0]), stage=PREDICT)
        return b.key.decrypt(back[0])[:, 0]
