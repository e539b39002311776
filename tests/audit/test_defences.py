"""The defences of docs/audit.md as mechanisms: the calibrated Gaussian mechanism, pinned output
noise, the noisy proximal gradient, distillation."""

from __future__ import annotations

import math

import pytest
import torch

from fedloom.audit.defences import (
    PROBABILITY_SENSITIVITY,
    OutputNoise,
    distill,
    gaussian_delta,
    gaussian_sigma,
    noisy_prox,
)
from fedloom.audit.training import accuracy, train_sgd
from fedloom.core.functional import FunctionalModel
from fedloom.core.rng import generator
from fedloom.models import build_model


@pytest.mark.parametrize(("epsilon", "delta"), [(0.5, 1e-5), (1.0, 1e-5), (8.0, 1e-6)])
def test_gaussian_sigma_is_the_tight_analytic_calibration(epsilon: float, delta: float) -> None:
    sigma = gaussian_sigma(1.0, epsilon, delta)
    assert gaussian_delta(sigma, 1.0, epsilon) <= delta
    assert gaussian_delta(sigma * 0.99, 1.0, epsilon) > delta  # no smaller sigma works
    if epsilon < 1:  # the classic bound (Dwork & Roth, Theorem A.1) is valid and looser
        classic = math.sqrt(2 * math.log(1.25 / delta)) / epsilon
        assert sigma < classic
    assert gaussian_sigma(2.0, epsilon, delta) == pytest.approx(2 * sigma, rel=1e-9)


def test_gaussian_delta_matches_a_known_value() -> None:
    # Balle & Wang 2018: sigma = 1, sensitivity 1, epsilon 1 gives delta ~ 0.1269
    assert gaussian_delta(1.0, 1.0, 1.0) == pytest.approx(0.12693, abs=1e-4)


def test_output_noise_is_pinned_per_query_and_labelled() -> None:
    module = build_model("logreg", (4,), 3)
    model = FunctionalModel(module, "classification")
    trained = model.initial_state(0)
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(1))
    mech = OutputNoise.calibrated(1.0, 1e-5, seed=0)
    a, b = mech.release(model, trained, x), mech.release(model, trained, x[[2, 0]])
    assert torch.equal(a.values[[2, 0]], b.values)  # same query, same answer, any batch
    assert not torch.equal(a.values[0], a.values[1])
    assert mech.epsilon == 1.0 and "epsilon=1" in mech.label
    assert mech.sigma == pytest.approx(gaussian_sigma(PROBABILITY_SENSITIVITY, 1.0, 1e-5))
    raw = OutputNoise(2.0, "logits")
    assert raw.epsilon is None and raw.label == "uncalibrated (no epsilon)"
    queries = torch.randn(2000, 4)
    noisy = raw.release(model, trained, queries)
    clean = model.forward(*trained, queries).double()
    assert noisy.kind == "logits"
    assert (noisy.values - clean).std() == pytest.approx(2.0, rel=0.05)


def test_noisy_prox_adds_mu_xi_to_dittos_gradient() -> None:
    anchor = {"w": torch.zeros(20000)}
    params = {"w": torch.full((20000,), 2.0)}
    mu, sigma = 0.5, 3.0
    plain = noisy_prox(anchor, mu, 0.0, generator(0, "t"))(params)["w"]
    assert torch.equal(plain, torch.full((20000,), 1.0))  # mu (phi - w)
    fresh = noisy_prox(anchor, mu, sigma, generator(0, "t"))
    g1, g2 = fresh(params)["w"], fresh(params)["w"]
    noise = g1 - plain
    assert noise.mean().abs() < 0.05 and noise.std() == pytest.approx(mu * sigma, rel=0.03)
    assert not torch.equal(g1, g2)  # a fresh xi per step
    once = noisy_prox(anchor, mu, sigma, generator(0, "t"), fresh=False)
    assert torch.equal(once(params)["w"], once(params)["w"])  # one draw for the training


def test_distilled_student_learns_the_teacher_from_public_data_only() -> None:
    torch.manual_seed(0)
    x = torch.randn(600, 5)
    y = (x[:, 0] + x[:, 1] > 0).long()
    model = FunctionalModel(build_model("logreg", (5,), 2), "classification")
    start = model.initial_state(0)
    teacher = train_sgd(model, start, x[:300], y[:300], 30, 0.5, 32, generator(0, "t"))
    public = x[300:]  # labels never used
    student = distill(model, teacher, start, public, 30, 0.5, 32, generator(0, "s"))
    agree = model.forward(*student, public).argmax(1) == model.forward(*teacher, public).argmax(1)
    assert agree.double().mean() > 0.95
    assert accuracy(model, student, x[300:], y[300:]) > 0.9


def test_tradeoff_without_a_global_model_has_no_noisy_prox_rows() -> None:
    """A run without a global model (local training): personal models from the initial model
    with mu 0, so the noisy proximal term (mu xi) vanishes and is left out."""
    from fedloom.audit.membership import Pool, Reserve
    from fedloom.audit.study import StudySetup, defence_tradeoff
    from fedloom.data import from_arrays

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(400, 5, generator=gen)
    y = (x[:, 0] > 0).long()
    data = from_arrays([(x[:100], y[:100]), (x[100:200], y[100:200])])
    pool = Pool(x[200:], y[200:])
    reserve = Reserve(pool, pool, pool, "test")
    model = FunctionalModel(build_model("logreg", (5,), 2), "classification")
    setup = StudySetup(epochs=5, distill_epochs=2, members=40, epsilons=(1.0,), logit_sigmas=())
    study = defence_tradeoff(model, None, dict(enumerate(data.clients)), reserve, setup, 0)
    assert study["setup"]["mu"] == 0.0
    assert [r["defence"] for r in study["rows"]] == ["none", "distillation", "output_noise"]
    assert study["rows"][0]["auc_change"] == 0.0 and study["rows"][0]["diverged"] == 0
