"""pFedMac (labels (16)-(18) of algorithms/pfedmac.py): closed forms on least-squares clients,
the l1 inner solution's optimality, the reported sparsity, the three tiers (hubs), configuration
errors, and the shared learning setup.

Measured numbers are in the comments (torch 2.13, CPU, float32 models)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fedloom
from fedloom.algorithms import ALGORITHMS, parse_algorithm_config
from fedloom.algorithms.pfedmac import assign_hubs, zero_fraction
from fedloom.core.functional import FunctionalModel
from fedloom.core.pytree import num_bytes
from fedloom.errors import ConfigError
from tests.algorithms.oracle import (
    as_vector,
    max_curvature,
    optimum_vector,
    pfedmac_fixed_point,
    pfedmac_stationary_point,
    quadratic_data,
    run,
)
from tests.algorithms.pfl_setup import fedavg_accuracy_on_clients, pfl_config, run_pfl
from tests.algorithms.server_state_setup import make_algorithm, recorded_servers


@pytest.fixture
def servers(monkeypatch):
    return recorded_servers(monkeypatch)


def curvatures(data) -> tuple[float, float]:
    """Smallest and largest eigenvalue over the clients' Hessians."""
    hs = [h.double() for h in data.extras["hessians"]]
    return min(float(torch.linalg.eigvalsh(h).min()) for h in hs), max_curvature(data)


def digits_config(algorithm: dict, rounds: int = 2, **train) -> dict:
    return {
        "seed": 0,
        "data": {"name": "digits", "num_clients": 6, "partition": {"kind": "iid"}},
        "model": {"name": "mlp"},
        "algorithm": algorithm,
        "train": {"rounds": rounds, "local_steps": 5, "batch_size": 32, "lr": 0.05, **train},
        "eval": {"every": rounds},
        "executor": {"kind": "sequential"},
    }


# -- pFedMac: closed forms ----------------------------------------------------------------------


def test_pfedmac_fixed_point_is_the_composed_client_update():
    """Full batch, full participation: the client map theta^t -> theta_k is affine (R local
    steps of K inner gradient steps each, oracle.pfedmac_client_map), so the server's fixed
    point solves sum_k (I - A_k) theta = sum_k c_k whatever beta. Measured 1.1e-7 after 100
    rounds (K = 4, R = 3, beta = 0.7, Hessian spectra 0.38 .. 10.5)."""
    data = quadratic_data(num_clients=5, seed=0)
    low, high = curvatures(data)
    lam, lr, inner_lr = 0.5 * low, 0.5 / (0.5 * low), 1.0 / high
    target = pfedmac_fixed_point(data, lam, lr, inner_lr, inner_steps=4, local_steps=3)
    algorithm = {"name": "pfedmac", "lam": lam, "beta": 0.7, "inner_steps": 4, "inner_lr": inner_lr}
    result = run(data, algorithm, rounds=100, lr=lr, local_steps=3)
    assert float((as_vector(result.global_params) - target).norm()) < 1e-6
    # with R = 3 local steps and K = 4 inexact inner steps this is not problem (17)'s
    # stationary point (measured 0.26 apart): the test above would notice a wrong map
    assert float((target - pfedmac_stationary_point(data, lam)).norm()) > 0.2


def test_pfedmac_with_a_converged_inner_solver_solves_problem_17():
    """R = 1 local step and K = 80 inner steps (contraction 0.8^80 = 2e-8 per round) make the
    client step an exact gradient step on F_k, grad F_k(theta) = lam (theta - omega_k*(theta)),
    so the fixed point is the stationary point of (17): sum_k (I - lam H_k^{-1}) theta =
    sum_k x_k*; each client's personalized model is the inner argmin
    omega_k* = x_k* + lam H_k^{-1} theta. Measured: global 1.8e-7 from it after 40 rounds,
    personalized <= 4.4e-7; the pooled least-squares optimum is 0.71 away."""
    data = quadratic_data(num_clients=5, seed=0, feature_skew=False)
    low, high = curvatures(data)
    lam = 0.5 * low  # F_k is convex for lam < lambda_min(H_k)
    lr = 0.9 / lam
    algorithm = {"name": "pfedmac", "lam": lam, "inner_steps": 80, "inner_lr": 1.0 / high}
    result = run(data, algorithm, rounds=40, lr=lr, local_steps=1)
    theta = pfedmac_stationary_point(data, lam)
    assert float((as_vector(result.global_params) - theta).norm()) < 2e-6
    pooled = optimum_vector(data.extras["global_optimum"])
    assert float((pooled - theta).norm()) > 0.5
    for k, (h, opt) in enumerate(
        zip(data.extras["hessians"], data.extras["local_optima"], strict=True)
    ):
        personal = optimum_vector(opt) + lam * torch.linalg.solve(h.double(), theta)
        assert float((as_vector(result.client_params[k]) - personal).norm()) < 2e-6


def test_pfedmac_l1_inner_solution_satisfies_the_optimality_of_18():
    """gamma > 0: the inner problem argmin f_k(w) - lam <w, theta> + gamma ||w||_1 is solved by
    proximal gradient (soft threshold). Its optimality: g = H_k (w - x_k*) - lam theta equals
    -gamma sign(w_i) where w_i != 0 and |g_i| <= gamma where w_i = 0. theta is the global model
    the last round started from (the run with one round less). Measured: residual <= 5.9e-7,
    5 of 30 coordinates exactly zero, zero coordinates' |g_i| at least 0.057 below gamma."""
    data = quadratic_data(num_clients=5, seed=0, feature_skew=False)
    low, high = curvatures(data)
    lam, gamma = 0.5 * low, 0.5
    algorithm = {
        "name": "pfedmac",
        "lam": lam,
        "inner_steps": 80,
        "inner_lr": 1.0 / high,
        "gamma": gamma,
    }
    before = run(data, algorithm, rounds=5, lr=0.9 / lam, local_steps=1)
    result = run(data, algorithm, rounds=6, lr=0.9 / lam, local_steps=1)
    theta = as_vector(before.global_params)
    zeros = 0
    for k, (h, opt) in enumerate(
        zip(data.extras["hessians"], data.extras["local_optima"], strict=True)
    ):
        w = as_vector(result.client_params[k])
        g = h.double() @ (w - optimum_vector(opt)) - lam * theta
        nonzero = w != 0
        zeros += int((~nonzero).sum())
        assert float((g[nonzero] + gamma * torch.sign(w[nonzero])).abs().max()) < 5e-6
        if (~nonzero).any():
            assert float(g[~nonzero].abs().max()) <= gamma + 5e-6
    assert zeros >= 3


def test_pfedmac_sparsity_grows_with_gamma_and_is_reported(servers):
    """Fraction of exactly-zero weights of the deployed personalized models (2NN on digits, 2
    rounds of 5 local steps): 0 without the l1 term; measured 0.143 with gamma = 0.01 and 0.715
    with gamma = 0.05. The server keeps each client's reported value (ClientResult.info) and
    summary_extras gives their mean."""
    fractions = []
    for gamma in (0.0, 0.01, 0.05):
        config = digits_config({"name": "pfedmac", "gamma": gamma})
        result = fedloom.run(config, write=False, progress=False)
        fractions.append(np.mean([zero_fraction(p) for p in result.client_params.values()]))
        algorithm, server = servers[-1]
        reported = algorithm.summary_extras(server)["personal_sparsity_mean"]
        assert reported == pytest.approx(fractions[-1], abs=1e-9)  # every client trained
        assert result.summary["extras"]["personal_sparsity_mean"] == reported
        # the round's mean over reporting clients lands in the metrics rows
        # (every client reports each round here, so the two means are the same number)
        assert result.history[-1]["client_info"]["sparsity"] == pytest.approx(reported, abs=1e-9)
        assert "client" not in result.history[-1]["client_info"]
    assert fractions[0] == 0.0
    assert 0.1 < fractions[1] < fractions[2]


def test_pfedmac_sparsity_state_is_finite_and_marks_who_reported(servers):
    """Partial participation (2 of 6 clients a round, 1 round): the per-client sparsity of the
    server state (checkpointed) was NaN for the clients that had not trained; now 0 with a
    mask of the clients that reported, and the summary's mean is over those only."""
    config = digits_config({"name": "pfedmac"}, rounds=1, clients_per_round=2)
    result = fedloom.run(config, write=False, progress=False)
    algorithm, server = servers[-1]
    assert torch.isfinite(server["sparsity"]).all()
    reported = server["sparsity_reported"]
    assert int(reported.sum()) == 2
    assert (server["sparsity"][~reported] == 0).all()
    trained = [c for c in range(6) if bool(reported[c])]
    expected = np.mean([zero_fraction(result.client_params[c]) for c in trained])
    assert result.summary["extras"]["personal_sparsity_mean"] == pytest.approx(expected, abs=1e-12)
    fresh = algorithm.init_server_state(*algorithm.ctx.model.initial_state(0))
    assert algorithm.summary_extras(fresh)["personal_sparsity_mean"] is None


# -- pFedMac: three tiers ---------------------------------------------------------------------


def test_pfedmac_one_hub_equals_no_hierarchy():
    data = quadratic_data(num_clients=6, seed=1, samples=[20, 30, 40, 50, 60, 70])
    flat = run(data, {"name": "pfedmac", "beta": 0.8}, rounds=5, lr=0.1, local_steps=3)
    one = run(
        data, {"name": "pfedmac", "beta": 0.8, "hubs": [0] * 6}, rounds=5, lr=0.1, local_steps=3
    )
    for key, value in flat.global_params.items():
        assert torch.equal(value, one.global_params[key]), key
    assert flat.summary["communication"] == one.summary["communication"]


def test_pfedmac_hub_weighting(servers):
    """Hubs {0, 1, 2, 3} and {4, 5} with sample weights: 'reporting' (a hub weighs what its
    clients weigh) is the flat mean up to rounding (measured 1.5e-8); 'members' (2:1 here) and
    'uniform' (1:1) are other server means (measured 0.033 from flat, 0.037 from each other).
    The hub -> server uploads are counted: 2 hubs x 5 rounds x one model."""
    data = quadratic_data(num_clients=6, seed=1, samples=[20, 30, 40, 50, 60, 70])
    base = {"name": "pfedmac", "beta": 0.8, "weighting": "samples", "hubs": [0, 0, 0, 0, 1, 1]}

    def global_vector(**extra):
        result = run(data, {**base, **extra}, rounds=5, lr=0.1, local_steps=3)
        return as_vector(result.global_params)

    flat = as_vector(
        run(
            data, {"name": "pfedmac", "beta": 0.8, "weighting": "samples"}, 5, 0.1, local_steps=3
        ).global_params
    )
    assert float((global_vector(hub_weighting="reporting") - flat).norm()) < 1e-6
    members = global_vector(hub_weighting="members")
    algorithm, server = servers[-1]
    assert algorithm.summary_extras(server)["hub_bytes_up"] == 2 * 5 * num_bytes(server["params"])
    uniform = global_vector(hub_weighting="uniform")
    assert float((members - flat).norm()) > 1e-3
    assert float((uniform - members).norm()) > 1e-3


def test_hub_assignment():
    assert assign_hubs(5, 2, "round_robin", 0) == [0, 1, 0, 1, 0]
    drawn = assign_hubs(10, 3, "random", 7)
    assert sorted(drawn.count(h) for h in range(3)) == [3, 3, 4]
    assert drawn == assign_hubs(10, 3, "random", 7)
    assert drawn != assign_hubs(10, 3, "random", 8)


# -- configuration ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"name": "pfedmac", "gamma": -1.0}, "algorithm.gamma"),
        ({"name": "pfedmac", "lam": 0.0}, "algorithm.lam"),
        ({"name": "pfedmac", "beta": 3.0}, "algorithm.beta"),
        ({"name": "pfedmac", "inner_steps": 0}, "algorithm.inner_steps"),
        ({"name": "pfedmac", "num_hubs": 0}, "algorithm.num_hubs"),
        ({"name": "pfedmac", "hubs": [0, 1], "num_hubs": 2}, "num_hubs"),
        ({"name": "pfedmac", "hub_weighting": "size"}, "algorithm.hub_weighting"),
    ],
)
def test_invalid_hyperparameters_name_the_key(raw, key):
    assert raw["name"] in ALGORITHMS.names()
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_algorithm_config(raw)


def test_pfedmac_hubs_must_cover_every_client():
    with pytest.raises(ConfigError, match=r"algorithm\.hubs"):
        make_algorithm({"name": "pfedmac", "hubs": [0, 1]}, m=4)


# -- learning on the shared setup ---------------------------------------------------------------


@pytest.mark.heavy(budget=90)  # 27 s loaded; the closed-form pFedMac tests stay cheap
def test_pfedmac_personalizes_on_label_shards():
    # Measured (BASE setup of pfl_setup, 20 rounds, 20 local steps): with inner_steps 2 (here,
    # to keep the test at twice FedAvg's gradient steps) personalized mean 0.902, P10 0.759,
    # global model 0.139; with the default 5: 0.930, 0.852, 0.162 (lam = 0.1 gave 0.927 and
    # 0.945 but diverges at one local epoch, see the module docstring). The global model
    # learns slowly: lam = 0.01 moves theta by eta lam = 5e-4 of (theta - omega) per local
    # step. FedAvg's global model on the same clients: 0.6215.
    result = run_pfl({"name": "pfedmac", "inner_steps": 2})
    personalized = result.summary["final"]["personalized"]["accuracy_mean"]
    assert personalized > fedavg_accuracy_on_clients() + 0.25


def test_pfedmac_defaults_are_stable_at_one_local_epoch():
    """The inner problem of (16) is unbounded below on cross-entropy, so the global model's
    norm grows by about g = lr inner_lr K lam^2 R^2 / 2 a round (R local steps; see the module
    docstring). At one local epoch of the shared setup (R = 75) the old default lam = 0.1 has
    g = 0.35 (measured: 6e4 norm and clients collapsing in 20 rounds); the default lam = 0.01
    has g = 0.0035 (measured: norm 11.7 -> 12.7 in 20 rounds, personalized mean 0.967, min
    0.920). Here 2 rounds of 2 clients (2 s): the global model's norm over its initial one,
    measured 1.008 with the default and 1.786 with lam = 0.1."""
    from fedloom.models import MLP

    def ratio(algorithm: dict) -> float:
        config = pfl_config(algorithm, rounds=2, clients_per_round=2)
        config["train"].update(local_steps=None, local_epochs=1)
        config["eval"] = {"every": 2}
        config["monitor"] = {"enabled": False}
        config["executor"] = {"kind": "sequential"}
        result = fedloom.run(config, write=False, progress=False)
        norm = torch.cat([v.flatten() for v in result.global_params.values()]).norm()
        return float(norm / initial)

    model = FunctionalModel(MLP((1, 28, 28), 10), "classification")
    params, buffers = model.initial_state(0)
    initial = torch.cat([v.flatten() for v in {**params, **buffers}.values()]).norm()
    stable, old = ratio({"name": "pfedmac"}), ratio({"name": "pfedmac", "lam": 0.1})
    assert stable < 1.05
    assert old > 1.3
