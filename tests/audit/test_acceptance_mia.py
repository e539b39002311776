"""Membership inference (Yeom et al. 2018; Shokri et al. 2017) on finished runs read back from
their run directories: the setting of docs/audit.md, "Measured" (Fashion-MNIST, 200 training
samples per client, the 2NN).

Test 3: a locally overfit model leaks (AUC >= 0.60), the FedAvg global model hardly
(<= 0.56), Ditto's personal models at lambda = 1 little (<= 0.57); means over 3 seeds. The
default run uses fewer clients than that setting's 20 (the locally trained models' AUC does
not depend on the number of clients; the global model of fewer clients has fewer members per
parameter, so the bound is harder to meet); the slow one has 20. Measured (seeds
0-2): local 0.668, FedAvg global 0.502, Ditto lambda=1 0.514 at 20 clients; 0.665, 0.496,
0.515 at 8.

Test 4: the defence trade-off table around personal models trained from a FedAvg model.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

import pytest

from fedloom.audit.study import StudySetup
from tests.audit.conftest import AuditOf

SEEDS = (0, 1, 2)


def _mean(values: list[float]) -> float:
    return statistics.fmean(values)


def _check_test_3(audit_of: AuditOf, local_clients: int, clients: int) -> None:
    local = [audit_of("local", s, local_clients)["attacks"]["loss"] for s in SEEDS]
    fedavg = [audit_of("fedavg", s, clients)["attacks"]["loss"] for s in SEEDS]
    ditto = [audit_of("ditto_1", s, clients)["attacks"]["loss"] for s in SEEDS]
    assert all(r["global"] is None for r in local)  # local training has no global model
    local_auc = _mean([r["client_mean"]["auc"] for r in local])
    fedavg_auc = _mean([r["global"]["auc"] for r in fedavg])
    ditto_auc = _mean([r["client_mean"]["auc"] for r in ditto])
    assert local_auc >= 0.60, local_auc
    assert fedavg_auc <= 0.56, fedavg_auc
    assert ditto_auc <= 0.57, ditto_auc
    # the overfit models' leak shows in the loss gap, and the label-only attack sees it too
    assert _mean([r["clients"]["0"]["label_only"]["advantage"] for r in local]) > 0.1
    assert all(r["clients"]["0"]["members"] == 200 for r in local)


def test_acceptance_3_membership_inference(audit_of: AuditOf) -> None:
    _check_test_3(audit_of, local_clients=3, clients=8)


@pytest.mark.heavy(budget=150)  # measured 70 s on a loaded 2-core machine
def test_acceptance_3_membership_inference_spec_size(audit_of: AuditOf) -> None:
    _check_test_3(audit_of, local_clients=20, clients=20)


def test_shadow_attack_detects_overfit_models(audit_of: AuditOf) -> None:
    """Shokri et al.'s attack, trained on shadow models only, finds the overfit members too
    (measured 0.63 on seed 0)."""
    result = audit_of("local", 0, 3, attack="shadow")["attacks"]["shadow"]
    assert result["shadow"]["per_class_classifiers"] == 10
    assert result["client_mean"]["auc"] >= 0.58


STUDY = StudySetup(mu=0.1, epochs=50, members=200, clients=4, prox_sigmas=(1.0,))


@pytest.fixture(scope="module")
def tradeoff(audit_of: AuditOf) -> list[dict[str, Any]]:
    doc = audit_of("fedavg", 0, 8, defences=True, study=STUDY)
    return doc["defences"]["rows"]


def test_acceptance_4_defence_tradeoff(tradeoff: list[dict[str, Any]]) -> None:
    base, *rows = tradeoff
    assert base["defence"] == "none" and base["guarantee"] == "undefended"
    assert base["auc"] >= 0.54  # the personal models leak before any defence
    assert {r["defence"] for r in rows} == {"noisy_prox", "distillation", "output_noise"}
    for r in rows:  # the accuracy cost is shown for every defence
        assert math.isfinite(r["accuracy"]) and r["accuracy_cost"] == pytest.approx(
            base["accuracy"] - r["accuracy"]
        )
    for r in rows:
        if r["defence"] in ("distillation", "output_noise"):
            assert r["auc"] <= base["auc"] - 0.01, r
    for r in rows:  # (epsilon, delta) only where the noise is calibrated
        calibrated = r["defence"] == "output_noise" and "on probabilities" in r["setting"]
        assert ("epsilon=" in r["guarantee"] and "delta=" in r["guarantee"]) == calibrated, r
    assert all(
        r["guarantee"] == "uncalibrated (no epsilon)"
        for r in rows
        if r["defence"] == "output_noise" and "on logits" in r["setting"]
    )
    noisy = [r for r in rows if r["defence"] == "noisy_prox"]
    assert noisy and all(r["guarantee"] == "heuristic (no epsilon)" for r in noisy)
    strongest = min((r for r in rows if "epsilon=1," in r["guarantee"]), key=lambda r: r["auc"])
    assert strongest["accuracy_cost"] > 0.3  # epsilon 1 on the whole output: a steep price


@pytest.mark.xfail(
    strict=True,
    reason="measured: the noisy proximal term of docs/audit.md does not lower the loss attack's "
    "AUC at "
    "the same mu (20 clients, 3 seeds: xi fresh each step -0.002 to +0.031, xi drawn once "
    "+0.03 to +0.14; benchmarks/mia_defences.py, docs/audit.md)",
)
def test_acceptance_4_noisy_prox_lowers_auc(tradeoff: list[dict[str, Any]]) -> None:
    """The expectation that defence (1), the noisy proximal term, lowers the AUC like the others:
    a drop of at least 0.02, as distillation and output noise achieve here."""
    base = tradeoff[0]
    for r in tradeoff:
        if r["defence"] == "noisy_prox":
            assert r["auc"] <= base["auc"] - 0.02, r
