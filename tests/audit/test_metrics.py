"""ROC curve, AUC, TPR at 1% FPR and PSNR against scikit-learn and hand-computed values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from sklearn.metrics import roc_auc_score
from sklearn.metrics import roc_curve as sk_roc_curve

from fedloom.audit.metrics import attack_summary, psnr, rates, roc_curve


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_roc_matches_sklearn_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 2, 400)
    scores = np.round(rng.normal(size=400) + 0.7 * labels, 1)  # rounded: many ties
    roc = roc_curve(scores, labels)
    assert roc.auc == pytest.approx(roc_auc_score(labels, scores), abs=1e-12)
    fpr, tpr, thresholds = sk_roc_curve(labels, scores, drop_intermediate=False)
    np.testing.assert_allclose(roc.fpr, fpr)
    np.testing.assert_allclose(roc.tpr, tpr)
    np.testing.assert_allclose(roc.thresholds[1:], thresholds[1:])


def test_auc_known_values() -> None:
    labels = np.array([1, 1, 0, 0])
    assert roc_curve(np.array([4.0, 3, 2, 1]), labels).auc == 1.0
    assert roc_curve(np.array([1.0, 2, 3, 4]), labels).auc == 0.0
    assert roc_curve(np.zeros(4), labels).auc == 0.5  # all tied: chance
    # P(member score > non-member score) over the 4 pairs
    assert roc_curve(np.array([3.0, 1, 2, 0]), labels).auc == 0.75  # 3>2, 3>0, 1>0; not 1>2
    assert roc_curve(np.array([3.0, 1, 5, 0]), labels).auc == 0.5  # 3>0, 1>0; not 3>5, 1>5
    assert roc_curve(np.array([2.0, 1, 2, 0]), labels).auc == 0.625  # a tie counts half


def test_tpr_at_low_fpr() -> None:
    # 200 non-members scored 0..199, 100 members: 30 above every non-member, 70 at -1
    nonmembers = np.arange(200.0)
    members = np.r_[np.full(30, 500.0), np.full(70, -1.0)]
    scores = np.r_[members, nonmembers]
    labels = np.r_[np.ones(100), np.zeros(200)]
    roc = roc_curve(scores, labels)
    assert roc.tpr_at_fpr(0.01) == pytest.approx(0.30)  # 2 non-members may be flagged: no gain
    assert roc.tpr_at_fpr(0.0) == pytest.approx(0.30)
    assert roc.max_advantage() == pytest.approx(0.30)
    summary = attack_summary(scores, labels)
    assert summary["members"] == 100 and summary["nonmembers"] == 200
    assert summary["roc"]["fpr"][0] == 0.0 and summary["roc"]["tpr"][-1] == 1.0


def test_rates_of_a_hard_decision() -> None:
    r = rates(np.array([1, 1, 0, 1, 0, 0]), np.array([1, 1, 1, 0, 0, 0]))
    assert r["tpr"] == pytest.approx(2 / 3) and r["fpr"] == pytest.approx(1 / 3)
    assert r["advantage"] == pytest.approx(1 / 3) and r["auc"] == pytest.approx(2 / 3)


def test_roc_rejects_one_class() -> None:
    with pytest.raises(ValueError, match="both classes"):
        roc_curve(np.ones(3), np.ones(3))


def test_psnr() -> None:
    x = torch.full((1, 4, 4), 0.5)
    assert psnr(x, x + 0.1) == pytest.approx(20.0)  # MSE 0.01
    assert psnr(x, x) == math.inf
    assert psnr(torch.ones(4), torch.full((4,), 3.0)) == math.inf  # clipped to the range
    assert psnr(x * 255, x * 255 + 25.5, data_range=255.0) == pytest.approx(20.0)
