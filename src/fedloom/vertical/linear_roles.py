"""The roles of secure vertical linear and logistic regression (docs/vertical.md;
Yang et al. 2019, Table 1; Hardy et al. 2017) and the loss family they share.

Both losses are quadratic in the joint score z_i = u_i^A + u_i^B (u^K = Θ_K·x^K):
ℓ(z, y) = a z² + b(y) z + c(y), so the residual ("fore-gradient") is d = 2a z + b and

- linear:   a = ½, b = −y, c = ½y²   (ℓ = ½(z − y)², d = z − y);
- logistic: a = ⅛, b = −½y, c = log 2 with y ∈ {−1, +1} (Hardy et al.'s Taylor expansion of
  log(1 + e^{−yz}) at 0; d = ¼z − ½y, FATE's fore-gradient).

L = (1/s) Σ_{i∈S} ℓ(z_i, y_i) + (λ/2)(‖Θ_A‖² + ‖Θ_B‖²), ∂L/∂Θ_K = (1/s) Σ d_i x_i^K + λΘ_K.
The loss splits as (1/s)[a Σ(u^A)² + Σ(a (u^B)² + b u^B + c) + Σ (2a u^B + b) u^A] + reg, so
the label party B needs only [[u^A]] and [[a/s Σ(u^A)² + λ/2‖Θ_A‖²]] from A.

Roles: :class:`FeatureParty` (A: a feature block, no labels), :class:`LabelParty` (B: its block
with a column of ones for the intercept, and the labels), :class:`KeyHolder` (the coordinator
C of the three-party protocol; in the two-party protocol each data party holds its own key and
plays this part for the other). Every method takes the backend of the key it works under.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedloom.vertical.he import EncryptedArray, HEBackend, Mask, MaskedValues
from fedloom.vertical.messages import Channel, Party


@dataclass(frozen=True)
class QuadraticLoss:
    """ℓ(z, y) = a z² + b(y) z + c(y) (module docstring)."""

    name: str
    a: float

    def b(self, y: np.ndarray) -> np.ndarray:
        return -y if self.name == "linear" else -0.5 * y

    def c(self, y: np.ndarray) -> np.ndarray:
        return 0.5 * y**2 if self.name == "linear" else np.full(y.shape, math.log(2.0))

    def residual_part(self, u_b: np.ndarray, y: np.ndarray) -> np.ndarray:
        """B's share of the residual, 2a u^B + b(y) (d = 2a u^A + this)."""
        return 2 * self.a * u_b + self.b(y)

    def value(self, z: np.ndarray, y: np.ndarray) -> float:
        return float(np.mean(self.a * z**2 + self.b(y) * z + self.c(y)))


LINEAR = QuadraticLoss("linear", 0.5)
TAYLOR_LOGISTIC = QuadraticLoss("taylor_logistic", 0.125)


class _DataParty(Party):
    """A party with a feature block and coefficients θ (plain, never sent)."""

    def __init__(
        self, name: str, channel: Channel, x: np.ndarray, lr: float, reg_lambda: float
    ) -> None:
        super().__init__(name, channel)
        self.x = x
        self.theta = np.zeros(x.shape[1])
        self.lr = lr
        self.reg_lambda = reg_lambda
        self.last_gradient: np.ndarray | None = None
        self.key: HEBackend | None = None
        """Two-party protocol: the party's own key pair (it decrypts for the other party)."""

    def design(self, x: np.ndarray) -> np.ndarray:
        return x

    def scores(self, x: np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
        """u = Θ·x for the party's own rows (or for new rows ``x``, at prediction)."""
        block = self.x if x is None else self.design(x)
        return (block if rows is None else block[rows]) @ self.theta

    def masked_gradient(
        self, backend: HEBackend, d: EncryptedArray, rows: np.ndarray
    ) -> tuple[EncryptedArray, Mask | None]:
        """[[Σ_i d_i x_i + R]] under ``backend``'s key, and R (kept). The public 1/s is applied
        after unmasking, so that its fixed-point rounding does not enter every term."""
        g = backend.matmul_plain(self.x[rows].T, d)
        return backend.mask(g)

    def step(self, backend: HEBackend, masked: MaskedValues, mask: Mask | None, batch: int) -> None:
        """Remove R, divide by s, add λΘ (each owner adds its regulariser), take the step."""
        grad = backend.unmask(masked, mask) / batch + self.reg_lambda * self.theta
        self.last_gradient = grad
        self.theta = self.theta - self.lr * grad

    def decrypt_masked(self, masked: EncryptedArray) -> MaskedValues:
        """Two-party protocol: decrypt the other party's masked gradient (sees g + R only)."""
        return _own_key(self.key).decrypt_masked(masked)


class FeatureParty(_DataParty):
    """Party A (a host): features only."""

    def score_ciphertexts(
        self, backend: HEBackend, loss: QuadraticLoss, rows: np.ndarray
    ) -> tuple[EncryptedArray, EncryptedArray, np.ndarray]:
        """[[u^A]] and [[s·L_A]] = [[a Σ (u^A)² + s·λ/2 ‖Θ_A‖²]] (A → B, Yang et al.
        2019, Table 1; losses travel multiplied by the public s and are divided after
        decryption), and u^A."""
        u = self.scores(rows=rows)
        reg = 0.5 * self.reg_lambda * float(self.theta @ self.theta)
        l_a = loss.a * float(u @ u) + len(rows) * reg
        return backend.encrypt(u), backend.encrypt(np.array([l_a])), u

    def cross_loss(
        self, backend: HEBackend, loss: QuadraticLoss, prefix: EncryptedArray, rows: np.ndarray
    ) -> EncryptedArray:
        """[[2a Σ_i u_i U_i]] for the other hosts' summed scores [[U]] (the cross terms of
        a(Σ_k u^{A_k})², module linear_model), re-randomised: a fresh-looking ciphertext to
        the guest, which knows the [[U]] it sent."""
        u = self.scores(rows=rows)
        return backend.rerandomize(backend.matmul_plain(2 * loss.a * u[None, :], prefix))


class LabelParty(_DataParty):
    """Party B (the guest): features, a column of ones (its coefficient is the intercept) and
    the labels (±1 for the logistic loss)."""

    def __init__(
        self,
        name: str,
        channel: Channel,
        x: np.ndarray,
        y: np.ndarray,
        lr: float,
        reg_lambda: float,
        fit_intercept: bool,
    ) -> None:
        self.fit_intercept = fit_intercept
        super().__init__(name, channel, self.design(x), lr, reg_lambda)
        self.y = y

    def design(self, x: np.ndarray) -> np.ndarray:
        if not self.fit_intercept:
            return x
        return np.hstack([x, np.ones((x.shape[0], 1))])

    def residual_part(self, loss: QuadraticLoss, rows: np.ndarray) -> np.ndarray:
        return loss.residual_part(self.scores(rows=rows), self.y[rows])

    def residuals(
        self, backend: HEBackend, loss: QuadraticLoss, u_a: EncryptedArray, rows: np.ndarray
    ) -> EncryptedArray:
        """[[d]] = 2a ⊗ [[u^A]] ⊕ (2a u^B + b) (Yang et al. 2019, Table 1)."""
        scaled = u_a if loss.a == 0.5 else backend.mul_plain(u_a, 2 * loss.a)
        return backend.add_plain(scaled, self.residual_part(loss, rows))

    def loss_ciphertext(
        self,
        backend: HEBackend,
        loss: QuadraticLoss,
        u_a: EncryptedArray,
        l_a: EncryptedArray,
        rows: np.ndarray,
    ) -> EncryptedArray:
        """[[s·L]] = [[s·L_A]] ⊕ Σ_i (2a u^B_i + b_i) ⊗ [[u^A_i]] ⊕ plain part (Yang et al.
        2019, Table 1); whoever decrypts it divides by the public s."""
        s = len(rows)
        u_b, y = self.scores(rows=rows), self.y[rows]
        cross = backend.matmul_plain(loss.residual_part(u_b, y)[None, :], u_a)
        own = float(np.sum(loss.a * u_b**2 + loss.b(y) * u_b + loss.c(y)))
        own += s * 0.5 * self.reg_lambda * float(self.theta @ self.theta)
        return backend.add_plain(backend.add(cross, l_a), np.array([own]))


class KeyHolder(Party):
    """Decrypts what it is sent: masked gradients (it sees g + R only) and the loss."""

    def __init__(self, name: str, channel: Channel, key: HEBackend) -> None:
        super().__init__(name, channel)
        self.key = key

    def decrypt_masked(self, masked: EncryptedArray) -> MaskedValues:
        return self.key.decrypt_masked(masked)

    def decrypt_loss(self, enc_loss: EncryptedArray, batch: int) -> float:
        """L from [[s·L]]."""
        return float(self.key.decrypt(enc_loss)[0]) / batch


def _own_key(key: HEBackend | None) -> HEBackend:
    if key is None or not key.can_decrypt:
        raise PermissionError("this party holds no private key")
    return key
