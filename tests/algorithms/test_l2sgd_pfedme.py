"""L2SGD and pFedMe (Hanzely & Richtarik, 2020, arXiv:2002.05516; Dinh et al., NeurIPS 2020,
arXiv:2006.08848; labels of algorithms/l2sgd.py and pfedme.py) on least-squares clients.

The clients (``feature_skew: false``, 100 samples) have Hessians with eigenvalues in
[1.14, 3.46] and local optima 1.2-3.3 apart from the uniform consensus optimum. On them:

* both algorithms follow their pseudocode step for step (float64 re-implementations below,
  from the papers' pseudocode, full-batch gradients);
* both reach the solution of the mixed-model problem, (1) for L2SGD and (3) for pFedMe, which is
  the same point (checked): lambda -> 0 gives the local optima, large lambda the consensus;
* pFedMe's beta = 1 is plain averaging of the omega's and beta > 1 extrapolates (7).

Measured numbers are in the comments.
"""

from __future__ import annotations

import pytest
import torch

from fedloom.algorithms.l2sgd import local_step_count
from fedloom.core.functional import FunctionalModel
from fedloom.errors import ConfigError
from fedloom.models import build_model
from tests.algorithms.oracle import (
    as_vector,
    l2sgd_mixed_solution,
    optimum_vector,
    pfedme_mixed_solution,
    quadratic_data,
    run,
    weighted_optimum,
)
from tests.algorithms.pfl_setup import fedavg_accuracy_on_clients, run_pfl

K = 5


@pytest.fixture(scope="module")
def data():
    return quadratic_data(num_clients=K, seed=0, samples=100, feature_skew=False)


@pytest.fixture(scope="module")
def quadratics(data) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(H_k, w_k*): grad F_k(w) = H_k (w - w_k*) for the mean squared error F_k."""
    hessians = [h.double() for h in data.extras["hessians"]]
    return hessians, [optimum_vector(o) for o in data.extras["local_optima"]]


@pytest.fixture(scope="module")
def init(data) -> torch.Tensor:
    model = FunctionalModel(build_model("logreg", data.input_shape, data.num_outputs), data.task)
    return as_vector(model.initial_state(0)[0])  # run seed 0 (oracle.run)


def personal(result) -> list[torch.Tensor]:
    return [as_vector(result.client_params[k]) for k in range(K)]


def max_distance(models: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    return max(float((m - t).norm()) for m, t in zip(models, targets, strict=True))


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


# -- L2SGD ------------------------------------------------------------------------------------


def l2sgd_reference(quadratics, init, lam, p, eta, rounds, seed=0):
    """L2SGD's pseudocode (Hanzely & Richtarik 2020), iteration by iteration, in float64:
    each iteration the shared coin says 'no communication' (local gradient step scaled
    1/(K(1-p))) or 'communicate' (average, then the step scaled lam/(K p) towards it). A round of
    the engine ends with a communication; ``local_step_count`` is that coin."""
    hessians, optima = quadratics
    thetas = [init.clone() for _ in range(K)]
    for round in range(1, rounds + 1):
        for _ in range(local_step_count(seed, round, p)):
            grads = [h @ (t - o) for t, h, o in zip(thetas, hessians, optima, strict=True)]
            thetas = [t - eta / (K * (1 - p)) * g for t, g in zip(thetas, grads, strict=True)]
        average, before = sum(thetas) / K, thetas
        thetas = [t - eta * lam / (K * p) * (t - average) for t in thetas]
    return average, before  # theta_bar, and the theta_k just before the last averaging step


def l2sgd(data, lam: float, p: float, local_lr: float, rounds: int, **train):
    """Runs L2SGD with local steps eta / (K (1-p)) = ``local_lr``."""
    eta = local_lr * K * (1 - p)
    return run(data, {"name": "l2sgd", "lam": lam, "p": p}, rounds=rounds, lr=eta, **train)


def test_local_step_count_is_the_geometric_coin():
    p = 0.25
    counts = [local_step_count(3, r, p) for r in range(1, 4001)]
    assert counts == [local_step_count(3, r, p) for r in range(1, 4001)]  # a seeded stream
    mean = sum(counts) / len(counts)
    assert abs(mean - (1 - p) / p) < 0.15  # (1-p)/p = 3; measured 3.03
    zeros = counts.count(0) / len(counts)
    assert abs(zeros - p) < 0.03  # P(N = 0) = p: communicate at once; measured 0.245


def test_l2sgd_follows_the_pseudocode(data, quadratics, init):
    lam, p, local_lr, rounds = 2.0, 0.3, 0.1, 25
    result = l2sgd(data, lam, p, local_lr, rounds)
    eta = local_lr * K * (1 - p)
    average, thetas = l2sgd_reference(quadratics, init, lam, p, eta, rounds)
    # deployed: theta_k just before the last averaging step; global: theta_bar
    assert max_distance(personal(result), thetas) < 1e-5  # measured 8.6e-8
    assert float((as_vector(result.global_params) - average).norm()) < 1e-5  # 4.6e-8
    moved = max_distance(thetas, [init] * K)
    assert moved > 0.5, moved  # a real trajectory (measured 3.2)


def test_l2sgd_with_lambda_zero_reaches_the_local_optima(data, quadratics):
    result = l2sgd(data, lam=0.0, p=0.5, local_lr=0.3, rounds=100)
    assert max_distance(personal(result), quadratics[1]) < 1e-5  # measured 2e-7


def test_l2sgd_converges_to_the_solution_of_1(data):
    """Plain L2SGD (no variance reduction) has a noise floor: at the solution the local phase
    still moves theta_k by N eta/(K(1-p)) grad f_k(theta_k*) != 0 and the communication step
    pulls it back. The average theta_bar barely feels it (sum_k grad f_k(theta_k*) = 0) and
    converges as eta shrinks; the personal models fluctuate around theta_k*."""
    lam = 1.0
    bar, thetas = l2sgd_mixed_solution(data, lam)
    errors = {}
    for local_lr in (0.08, 0.02):  # averaging steps eta lam / (K p) = 0.08 and 0.02
        result = l2sgd(data, lam, 0.5, local_lr, rounds=600)  # the same coins: the same N_t
        errors[local_lr] = float((as_vector(result.global_params) - bar).norm())
        # measured 0.056 and 0.17 (last N_t: 3, 0, 1); the solution is 1.09 from the local
        # optima and 2.18 from the consensus
        assert max_distance(personal(result), thetas) < 0.25
    # measured 2.8e-2 and 4.7e-3
    assert errors[0.02] < 1e-2
    assert errors[0.02] < errors[0.08] / 4


def test_l2sgd_with_large_lambda_approaches_the_consensus_optimum(data, quadratics):
    lam = 100.0
    result = l2sgd(data, lam, 0.5, local_lr=0.01, rounds=600)  # averaging step 1
    bar, thetas = l2sgd_mixed_solution(data, lam)
    # measured 2.8e-3 (theta_bar) and 3.4e-3 (theta_k): the noise floor shrinks like 1/lam
    assert float((as_vector(result.global_params) - bar).norm()) < 1e-2
    assert max_distance(personal(result), thetas) < 1e-2
    consensus = weighted_optimum(data, torch.full((K,), 1.0 / K))
    # measured 0.068 (the solution: 0.066), against 1.2-3.3 from the consensus to the local
    # optima
    assert max_distance(personal(result), [consensus] * K) < 0.1
    assert max_distance(personal(result), quadratics[1]) > 3.0


@pytest.mark.parametrize(
    "train",
    [
        {"clients_per_round": 3},
        {"stragglers": 0.4, "local_steps": 10},
        {"stragglers": 0.4, "straggler_mode": "drop"},
    ],
    ids=["3_of_5_clients", "partial_stragglers", "dropped_stragglers"],
)
def test_l2sgd_partial_participation_keeps_theta_bar_the_mean_of_all_clients(data, train):
    """The extension: absent clients stay frozen and the server adds (1/K) of the uploaded
    changes, so theta_bar stays the mean over all K clients (= mean of the deployed models)
    and the iteration still solves (1)."""
    lam = 1.0
    result = l2sgd(data, lam, 0.5, local_lr=0.02, rounds=600, **train)
    mean = sum(personal(result)) / K
    assert float((mean - as_vector(result.global_params)).norm()) < 1e-5  # measured <= 3.5e-6
    bar, thetas = l2sgd_mixed_solution(data, lam)
    # measured (theta_bar, theta_k): 3 of 5 clients 0.033, 0.13; partial stragglers 0.025,
    # 0.39; dropped stragglers 0.010, 0.10 (the noise floor of the full-participation test)
    assert float((as_vector(result.global_params) - bar).norm()) < 5e-2
    assert max_distance(personal(result), thetas) < 0.5


def test_l2sgd_config_is_validated(data):
    for bad in ({"p": 0.0}, {"p": 1.0}, {"lam": -1.0}):
        with pytest.raises(ConfigError, match=rf"algorithm\.{next(iter(bad))}"):
            run(data, {"name": "l2sgd", **bad}, rounds=1, lr=0.1)
    # train.lr * lam / (K p) = 1.0 * 10 / (5 * 0.5) = 4 > 2: the averaging step diverges
    with pytest.raises(ConfigError, match=r"algorithm\.lam"):
        run(data, {"name": "l2sgd", "lam": 10.0, "p": 0.5}, rounds=1, lr=1.0)


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


# -- checkpoints ------------------------------------------------------------------------------


# (kill-and-resume for both: tests/engine/test_determinism.py)


# -- learning (tests/algorithms/pfl_setup.py: Fashion-MNIST, 2 label shards per client) --------


@pytest.mark.heavy(budget=60)  # measured 26 s on a loaded 2-core machine
def test_l2sgd_personal_models_beat_fedavg_on_label_skew():
    # Full participation (the paper's setting), 10 rounds; train.lr = 0.9 gives local steps of
    # 0.9 / (K (1-p)) = 0.05 (FedAvg's), averaging steps 0.9 * 0.1 / (20 * 0.1) = 0.045, and
    # E[N] = 9 local steps a round. Measured: personalized mean 0.938 (P10 0.861), global
    # 0.193 (lam = 0.1: a weak consensus), vs FedAvg's global model on the clients 0.6215.
    result = run_pfl(
        {"name": "l2sgd", "lam": 0.1, "p": 0.1}, lr=0.9, clients_per_round=None, rounds=10
    )
    personalized = result.summary["final"]["personalized"]["accuracy_mean"]
    assert personalized > fedavg_accuracy_on_clients() + 0.25, personalized
    assert result.summary["final"]["global"] is not None


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
