"""L2SGD (Hanzely & Richtarik, 2020, arXiv:2002.05516; labels of algorithms/l2sgd.py) on the
least-squares clients of tests/algorithms/mixed_model_setup.py: it follows its pseudocode step
for step (a float64 re-implementation below, full-batch gradients), reaches the solution of the
mixed-model problem (1) (lambda -> 0 gives the local optima, large lambda the consensus), keeps
theta_bar the mean of all clients under partial participation, and learns on the shared
Fashion-MNIST shards setup. Measured numbers are in the comments."""

from __future__ import annotations

import pytest
import torch

from fedloom.algorithms.l2sgd import local_step_count
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


# (kill-and-resume for L2SGD and pFedMe: tests/engine/test_determinism.py)


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
