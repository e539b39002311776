"""Federated transfer learning's model and Taylor objective in the clear (Liu et al.,
arXiv:1812.03337, Sections 3-4; docs/vertical.md): the oracle the protocols are
tested against, and the pieces they share.

Source A holds x^A and labels y ∈ {−1, +1} for its N_A rows; target B holds x^B. The overlap
D_AB pairs rows of A and B; D_c ⊆ D_AB are the overlap pairs whose label enters the loss.
Representations u = tanh(x W) ∈ R^d (one layer per party), Φ^A = (1/N_A) Σ_{D_A} y_i u_i^A,
φ_i = Φ^A·u_i^B, prediction sign(φ). Objective (mean-reduced, as docs/vertical.md states it):

  L = (1/N_c) Σ_{D_c} (log 2 − ½ y_i φ_i + ⅛ φ_i²) + (γ/N_AB) Σ_{D_AB} ‖u_i^A − u_i^B‖²
      + (λ/2)(‖W_A‖² + ‖W_B‖²),

the logistic loss log(1 + e^{−yφ}) replaced by its second-order Taylor expansion at 0, and
ℓ_2 = ‖u^A‖² + ‖u^B‖² + κ u^A·u^B with κ = −2. Components (Taylor-approximated):
  ∂L/∂u_i^B = (1/N_c)(−½ y_i + ¼ φ_i) Φ^A [i ∈ D_c] + (γ/N_AB)(2u_i^B + κ u_i^A) [i ∈ D_AB],
  ∂L/∂u_k^A = (y_k/N_A)(1/N_c) Σ_{i∈D_c} (−½ y_i + ¼ φ_i) u_i^B
              + (γ/N_AB)(2u_k^A + κ u_k^B) [k ∈ D_AB],
  ∂L/∂W = xᵀ(∂L/∂u ∘ (1 − u²)) + λW.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

KAPPA = -2.0
"""ℓ_2 = ‖u^A − u^B‖² splits as ‖u^A‖² + ‖u^B‖² + κ u^A·u^B."""


@dataclass(frozen=True)
class FTLParams:
    gamma: float = 1.0
    reg_lambda: float = 1e-3


@dataclass(frozen=True)
class Alignment:
    """Row indices: the overlap pairs (A row, B row) and which pairs are labelled (D_c)."""

    overlap_a: np.ndarray
    overlap_b: np.ndarray
    labelled: np.ndarray

    @property
    def labelled_a(self) -> np.ndarray:
        return self.overlap_a[self.labelled]

    @property
    def labelled_b(self) -> np.ndarray:
        return self.overlap_b[self.labelled]


def represent(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """u = tanh(x W)."""
    return np.tanh(x @ w)


def backprop(x: np.ndarray, u: np.ndarray, grad_u: np.ndarray) -> np.ndarray:
    """∂L/∂W = xᵀ(∂L/∂u ∘ (1 − u²)) (without the regulariser)."""
    return x.T @ (grad_u * (1.0 - u**2))


def jacobian_weights(x: np.ndarray, u: np.ndarray) -> list[np.ndarray]:
    """Per output column j, the plaintext matrix P_j = (x ∘ (1 − u_j²))ᵀ with
    ∂L/∂W[:, j] = P_j @ ∂L/∂u[:, j]: what a party applies to an encrypted ∂L/∂u."""
    d = 1.0 - u**2
    return [(x * d[:, j : j + 1]).T for j in range(u.shape[1])]


def phi_source(u_a: np.ndarray, y_a: np.ndarray) -> np.ndarray:
    """Φ^A = (1/N_A) Σ y_i u_i^A."""
    return y_a @ u_a / len(y_a)


@dataclass(frozen=True)
class FTLGradients:
    loss: float
    grad_wa: np.ndarray
    grad_wb: np.ndarray
    grad_ua: np.ndarray
    grad_ub: np.ndarray


def taylor_objective(
    w_a: np.ndarray,
    w_b: np.ndarray,
    x_a: np.ndarray,
    y_a: np.ndarray,
    x_b: np.ndarray,
    align: Alignment,
    params: FTLParams,
) -> FTLGradients:
    """L and its gradients by the component formulas (module docstring), in float64."""
    u_a, u_b = represent(x_a, w_a), represent(x_b, w_b)
    phi = phi_source(u_a, y_a)
    n_a, n_ab, n_c = len(y_a), len(align.overlap_a), len(align.labelled)
    y_c = y_a[align.labelled_a]
    ub_c = u_b[align.labelled_b]
    f = ub_c @ phi
    coeff = (-0.5 * y_c + 0.25 * f) / n_c
    ua_o, ub_o = u_a[align.overlap_a], u_b[align.overlap_b]
    l1 = float(np.mean(math.log(2.0) - 0.5 * y_c * f + 0.125 * f**2))
    l2 = params.gamma * float(np.sum((ua_o - ub_o) ** 2)) / n_ab
    reg = 0.5 * params.reg_lambda * float(np.sum(w_a**2) + np.sum(w_b**2))
    g_ub = np.zeros_like(u_b)
    np.add.at(g_ub, align.labelled_b, coeff[:, None] * phi[None, :])
    np.add.at(g_ub, align.overlap_b, params.gamma / n_ab * (2 * ub_o + KAPPA * ua_o))
    v = coeff @ ub_c
    g_ua = (y_a / n_a)[:, None] * v[None, :]
    np.add.at(g_ua, align.overlap_a, params.gamma / n_ab * (2 * ua_o + KAPPA * ub_o))
    return FTLGradients(
        l1 + l2 + reg,
        backprop(x_a, u_a, g_ua) + params.reg_lambda * w_a,
        backprop(x_b, u_b, g_ub) + params.reg_lambda * w_b,
        g_ua,
        g_ub,
    )
