"""pFedMe (Dinh et al., NeurIPS 2020, arXiv:2006.08848; labels of algorithms/pfedme.py) on the
least-squares clients of tests/algorithms/mixed_model_setup.py: its mixed-model problem (3) has
L2SGD's solution of (1) (checked), it follows its pseudocode step for step (a float64
re-implementation below, full-batch gradients) and reaches the solution of (3); beta = 1 is plain
averaging of the omega's and beta > 1 extrapolates (7); learning on the shared Fashion-MNIST
shards setup. Measured numbers are in the comments."""

from __future__ import annotations

import pytest
import torch

from fedloom.errors import ConfigError
from tests.algorithms.mixed_model_setup import (
    K,
    clients,
    hessians_and_optima,
    initial_vector,
    max_distance,
    personal,
)
from tests.algorithms.oracle import (
    as_vector,
    l2sgd_mixed_solution,
    pfedme_mixed_solution,
    run,
    weighted_optimum,
)
from tests.algorithms.pfl_setup import fedavg_accuracy_on_clients, run_pfl


@pytest.fixture(scope="module")
def data():
    return clients()


@pytest.fixture(scope="module")
def quadratics(data) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return hessians_and_optima(data)


@pytest.fixture(scope="module")
def init(data) -> torch.Tensor:
    return initial_vector(data)


# -- the mixed-model problem ------------------------------------------------------------------


def test_problems_1_and_3_have_the_same_solution_with_the_right_limits(data, quadratics):
    _, local = quadratics
    consensus = weighted_optimum(data, torch.full((K,), 1.0 / K))
    for lam in (0.1, 1.0, 10.0):
        bar1, thetas1 = l2sgd_mixed_solution(data, lam)
        bar3, thetas3 = pfedme_mixed_solution(data, lam)
        assert torch.allclose(bar1, bar3, atol=1e-10)
        assert max_distance(thetas1, thetas3) < 1e-10
    _, at_zero = l2sgd_mixed_solution(data, 0.0)
    assert max_distance(at_zero, local) < 1e-12
    bar, thetas = l2sgd_mixed_solution(data, 1e6)
    assert max_distance([*thetas, bar], [consensus] * (K + 1)) < 1e-5
    _, middle = l2sgd_mixed_solution(data, 1.0)
    assert max_distance(middle, local) > 1.0  # measured 1.09: the mixture is neither
    assert max_distance(middle, [consensus] * K) > 2.0  # measured 2.18


# -- pFedMe -----------------------------------------------------------------------------------


def pfedme_reference(quadratics, init, lam, eta, inner_lr, inner_steps, local_rounds, beta, rounds):
    """pFedMe's pseudocode (Dinh et al. 2020, Algorithm 1) with full-batch gradients, every
    client every round, in float64. The inner prox solver takes ``inner_steps`` gradient steps on
    f_k(theta_k) + lam/2 ||theta_k - omega||^2, warm-started from the previous theta_k (the
    global model at the start of the round)."""
    hessians, optima = quadratics
    theta = init.clone()
    personal_models: list[torch.Tensor] = []
    omegas: list[torch.Tensor] = []
    for _ in range(rounds):
        personal_models, omegas = [], []
        for h, opt in zip(hessians, optima, strict=True):
            omega, theta_k = theta.clone(), theta.clone()
            for _ in range(local_rounds):
                for _ in range(inner_steps):
                    theta_k = theta_k - inner_lr * (h @ (theta_k - opt) + lam * (theta_k - omega))
                omega = omega - eta * lam * (omega - theta_k)  # (6)
            personal_models.append(theta_k)
            omegas.append(omega)
        theta = (1 - beta) * theta + beta * sum(omegas) / K  # (7)
    return theta, personal_models, omegas


def pfedme(data, lam, eta, inner_lr, inner_steps, local_rounds, rounds, beta=1.0, **train):
    algorithm = {
        "name": "pfedme",
        "lam": lam,
        "inner_lr": inner_lr,
        "inner_steps": inner_steps,
        "beta": beta,
    }
    return run(data, algorithm, rounds=rounds, lr=eta, local_steps=local_rounds, **train)


@pytest.mark.parametrize("beta", [1.0, 2.0])
def test_pfedme_follows_the_pseudocode(data, quadratics, init, beta):
    setting = {"lam": 3.0, "eta": 0.1, "inner_lr": 0.1, "inner_steps": 4, "local_rounds": 3}
    result = pfedme(data, rounds=6, beta=beta, **setting)
    theta, thetas, _ = pfedme_reference(quadratics, init, beta=beta, rounds=6, **setting)
    assert float((as_vector(result.global_params) - theta).norm()) < 1e-5  # measured 1.5e-7
    assert max_distance(personal(result), thetas) < 1e-5
    assert float((theta - init).norm()) > 0.5  # measured 2.5 (beta 1), 2.8 (beta 2)


def test_pfedme_beta_one_is_plain_averaging_and_beta_extrapolates(data, quadratics, init):
    setting = {"lam": 3.0, "eta": 0.1, "inner_lr": 0.1, "inner_steps": 4, "local_rounds": 3}
    _, _, omegas = pfedme_reference(quadratics, init, beta=1.0, rounds=1, **setting)
    one = as_vector(pfedme(data, rounds=1, beta=1.0, **setting).global_params)
    assert float((one - sum(omegas) / K).norm()) < 1e-6  # the mean of the omega's: 5.6e-8
    for beta in (0.5, 2.0, 3.0):
        other = as_vector(pfedme(data, rounds=1, beta=beta, **setting).global_params)
        # (7): theta^1 = theta^0 + beta (mean omega - theta^0)
        assert torch.allclose(other - init, beta * (one - init), atol=1e-6)  # <= 1e-7


def test_pfedme_beta_above_one_converges_faster(data):
    """beta only scales the server step, so the fixed point (mean_k omega_k(theta) = theta)
    does not depend on it; with small client steps (eta lam = 0.1) beta = 2 gets there in
    fewer rounds, as the paper reports."""
    lam = 1.0
    setting = {"lam": lam, "eta": 0.1, "inner_lr": 0.3, "inner_steps": 10, "local_rounds": 1}
    bar, _ = pfedme_mixed_solution(data, lam)
    errors = {}
    for beta in (1.0, 2.0):
        result = pfedme(data, rounds=40, beta=beta, **setting)
        errors[beta] = float((as_vector(result.global_params) - bar).norm())
    assert errors[2.0] < errors[1.0] / 5  # measured 0.159 and 0.0076


@pytest.mark.parametrize(
    "lam, eta, inner_lr, inner_steps, rounds",
    [
        (0.01, 100.0, 0.4, 30, 10),  # eta lam = 1: omega <- theta_k
        (1.0, 1.0, 0.35, 30, 30),
        (10.0, 0.1, 0.08, 8, 150),
    ],
)
def test_pfedme_converges_to_the_solution_of_3(
    data, quadratics, lam, eta, inner_lr, inner_steps, rounds
):
    """With R = 1 local round and a prox solved to ~1e-8, pFedMe's fixed point is the solution
    of (3): theta = mean_k prox_k(theta), theta_k = prox_k(theta)."""
    bar, thetas = pfedme_mixed_solution(data, lam)
    result = pfedme(data, lam, eta, inner_lr, inner_steps, 1, rounds)
    # measured (theta, theta_k): 7e-8, 1.6e-7 (lam 0.01); 9e-8, 1.6e-7 (1); 4.6e-7, 5.0e-7 (10)
    assert float((as_vector(result.global_params) - bar).norm()) < 2e-6
    assert max_distance(personal(result), thetas) < 2e-6
    if lam < 0.1:  # measured 0.016 from the local optima: lambda -> 0 gives them
        assert max_distance(personal(result), quadratics[1]) < 0.05


def test_pfedme_with_many_local_rounds_drifts_from_3(data):
    """R > 1 local rounds are R gradient steps on the client's own Moreau envelope before
    averaging: FedAvg on the envelopes, whose fixed point drifts from the solution of (3)."""
    lam = 1.0
    bar, _ = pfedme_mixed_solution(data, lam)
    result = pfedme(data, lam, 1.0, 0.35, 10, 5, rounds=30)
    # measured 0.084 (R = 1 reaches it to 1e-7 above)
    assert float((as_vector(result.global_params) - bar).norm()) > 0.05


def test_pfedme_config_is_validated(data):
    for bad in ({"lam": 0.0}, {"inner_steps": 0}, {"inner_lr": 0.0}, {"beta": 0.0}):
        with pytest.raises(ConfigError, match=rf"algorithm\.{next(iter(bad))}"):
            run(data, {"name": "pfedme", **bad}, rounds=1, lr=0.1)


@pytest.mark.heavy(budget=45)  # measured 16 s on a loaded 2-core machine
def test_pfedme_personal_models_beat_fedavg_on_label_skew():
    # 10 rounds of R = 10 local rounds with K = 5 inner steps (5x FedAvg's gradient steps per
    # local step): lam = 1 lets the personal models move away from omega; eta lam = 0.5.
    # Measured: personalized mean 0.936 (P10 0.867), global 0.403, vs FedAvg's 0.6215.
    result = run_pfl(
        {"name": "pfedme", "lam": 1.0, "inner_lr": 0.05}, lr=0.5, rounds=10, local_steps=10
    )
    personalized = result.summary["final"]["personalized"]["accuracy_mean"]
    assert personalized > fedavg_accuracy_on_clients() + 0.25, personalized
    assert result.summary["final"]["global"] is not None
