"""Scores of an attack: the ROC curve, its area, the true-positive rate at a low false-positive
rate, the membership advantage, and the PSNR of a reconstructed image.

Conventions: a higher score means "member"; labels are 1 for members, 0 for non-members.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class Roc:
    """An ROC curve: one point per distinct score threshold, from (0, 0) to (1, 1)."""

    fpr: np.ndarray
    tpr: np.ndarray
    thresholds: np.ndarray
    """``thresholds[i]``: predict member iff score >= it (``inf`` for the first point)."""

    @property
    def auc(self) -> float:
        """Area under the curve (trapezoids): P(member score > non-member score) + 1/2 P(tie),
        the Mann-Whitney statistic."""
        return float(np.sum(np.diff(self.fpr) * (self.tpr[1:] + self.tpr[:-1])) / 2.0)

    def tpr_at_fpr(self, max_fpr: float = 0.01) -> float:
        """The largest TPR of a threshold whose FPR is at most ``max_fpr`` (Carlini et al.,
        "Membership Inference Attacks From First Principles", S&P 2022: the low-FPR regime that
        matters for a privacy audit). With N non-members, resolution is 1/N."""
        ok = self.fpr <= max_fpr + 1e-12
        return float(self.tpr[ok].max())

    def max_advantage(self) -> float:
        """max over thresholds of TPR - FPR (Yeom et al. 2018's membership advantage of the best
        threshold in hindsight)."""
        return float((self.tpr - self.fpr).max())

    def thinned(self, points: int = 201) -> dict[str, list[float]]:
        """At most ``points`` points of the curve (for JSON and plots; keeps both ends)."""
        n = len(self.fpr)
        idx = np.unique(np.linspace(0, n - 1, min(n, points)).round().astype(int))
        return {"fpr": self.fpr[idx].round(6).tolist(), "tpr": self.tpr[idx].round(6).tolist()}


def roc_curve(scores: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor) -> Roc:
    """The ROC curve of ``scores`` for binary ``labels`` (1 = member); tied scores form one
    point, so a tie contributes a diagonal segment (half credit)."""
    s = np.asarray(scores, dtype=np.float64).reshape(-1)
    y = np.asarray(labels).reshape(-1).astype(bool)
    if s.shape != y.shape:
        raise ValueError(f"{s.shape[0]} scores but {y.shape[0]} labels")
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        raise ValueError(f"an ROC curve needs both classes, got {pos} members, {neg} non-members")
    if not np.isfinite(s).all():
        raise ValueError("scores must be finite")
    order = np.argsort(-s, kind="mergesort")
    s, y = s[order], y[order]
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1]  # last index of each tie group
    tps = np.cumsum(y)[last]
    fps = last + 1 - tps
    return Roc(
        fpr=np.r_[0.0, fps / neg],
        tpr=np.r_[0.0, tps / pos],
        thresholds=np.r_[np.inf, s[last]],
    )


def rates(predicted: np.ndarray | torch.Tensor, labels: np.ndarray | torch.Tensor) -> dict:
    """TPR, FPR and advantage TPR - FPR of a hard member/non-member decision."""
    p = np.asarray(predicted).reshape(-1).astype(bool)
    y = np.asarray(labels).reshape(-1).astype(bool)
    tpr, fpr = float(p[y].mean()), float(p[~y].mean())
    return {"tpr": tpr, "fpr": fpr, "advantage": tpr - fpr, "auc": 0.5 * (1.0 + tpr - fpr)}


def psnr(reference: torch.Tensor, estimate: torch.Tensor, data_range: float = 1.0) -> float:
    """Peak signal-to-noise ratio 10 log10(range^2 / MSE) in dB, with the estimate clipped to
    the image range [0, ``data_range``] (DLG, Zhu et al. 2019; docs/audit.md); ``inf`` when equal.
    Computed in float64 so that a near-exact recovery is not floored by float32 rounding."""
    ref = reference.detach().to(torch.float64)
    est = estimate.detach().to(torch.float64).reshape(ref.shape).clamp(0.0, data_range)
    mse = float(((ref - est) ** 2).mean())
    return math.inf if mse == 0.0 else 10.0 * math.log10(data_range**2 / mse)


LOW_FPR = 0.01


def attack_summary(scores: np.ndarray | torch.Tensor, member: np.ndarray | torch.Tensor) -> dict:
    """What audit.json records of one attack on one target: ROC AUC, TPR at 1% FPR, the best
    threshold's advantage, the set's size and the (thinned) ROC curve."""
    roc = roc_curve(scores, member)
    m = np.asarray(member).astype(bool)
    return {
        "auc": roc.auc,
        "tpr_at_1pct_fpr": roc.tpr_at_fpr(LOW_FPR),
        "max_advantage": roc.max_advantage(),
        "members": int(m.sum()),
        "nonmembers": int((~m).sum()),
        "roc": roc.thinned(),
    }
