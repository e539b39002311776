"""FPFC (label (19) of algorithms/fpfc.py): the SCAD prox branch by branch, the ADMM server step
against a naive full-matrix transcription of the pseudocode, planted clusters, configuration
errors, and the shared learning setup.

Measured numbers are in the comments (torch 2.13, CPU, float32 models)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from sklearn.metrics import adjusted_rand_score

import fedloom
from fedloom.algorithms import ALGORITHMS, parse_algorithm_config
from fedloom.algorithms.base import ClientResult
from fedloom.algorithms.fpfc import connected_components, scad_prox, smoothed_scad
from fedloom.config import parse_config
from fedloom.core.pytree import num_bytes
from fedloom.data import load_dataset
from fedloom.errors import ConfigError
from tests.algorithms.pfl_setup import fedavg_accuracy_on_clients, pfl_config, run_pfl
from tests.algorithms.server_state_setup import make_algorithm, recorded_servers


@pytest.fixture
def servers(monkeypatch):
    return recorded_servers(monkeypatch)


# -- FPFC: the SCAD prox and the server step ----------------------------------------------------

LAM, A, XI, RHO = 0.6, 3.7, 1e-4, 1.0


@pytest.mark.parametrize(
    "norm, branch",
    [
        (5e-5, "ridge"),  # ||delta|| <= xi + lam/rho = 0.6001
        (0.5, "ridge"),
        (0.9, "lasso"),  # <= lam + lam/rho = 1.2
        (1.8, "concave"),  # <= a lam = 2.22
        (3.0, "identity"),
    ],
)
def test_scad_prox_branches(norm, branch):
    """Each branch of the prox against its formula, and against a brute-force minimization of
    the radial problem min_t g~(t) + rho/2 (t - ||delta||)^2 (the penalty is radial, so the
    prox is delta scaled): measured agreement 1e-7 on a 2e6-point grid."""
    direction = torch.randn(1, 7, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    delta = norm * direction / direction.norm()
    theta = scad_prox(delta, LAM, A, XI, RHO)
    formula = {
        "ridge": XI * RHO / (LAM + XI * RHO) * delta,
        "lasso": (1 - LAM / (RHO * norm)) * delta,
        "concave": (1 - A * LAM / ((A - 1) * RHO * norm)) / (1 - 1 / ((A - 1) * RHO)) * delta,
        "identity": delta,
    }[branch]
    assert torch.allclose(theta, formula, atol=1e-12, rtol=0)
    t = torch.linspace(0, norm, 2_000_001, dtype=torch.float64)
    objective = smoothed_scad(t, LAM, A, XI) + RHO / 2 * (t - norm) ** 2
    best = float(t[objective.argmin()])
    assert abs(float(theta.norm()) - best) <= 2 * norm / 2_000_000 + 1e-9


def test_smoothed_scad_is_continuous():
    for knot in (XI, LAM, A * LAM):
        t = torch.tensor([knot - 1e-9, knot + 1e-9], dtype=torch.float64)
        values = smoothed_scad(t, LAM, A, XI)
        assert abs(float(values[1] - values[0])) < 1e-8, knot


@pytest.mark.parametrize("pairs", ["active", "touching"])
def test_fpfc_server_step_matches_the_pseudocode(pairs):
    """The server step on stored i < j pairs equals the pseudocode written with full m x m
    antisymmetric tables theta_ij, v_ij and a double loop (measured 1e-7)."""
    m, gen = 5, torch.Generator().manual_seed(3)
    algorithm, params, buffers = make_algorithm({"name": "fpfc", "pairs": pairs}, m)
    server = algorithm.init_server_state(params, buffers)
    d = server["omega"].shape[1]
    omega = torch.randn(m, d, generator=gen)
    theta = torch.zeros(m, m, d)
    dual = torch.zeros(m, m, d)
    for p, (i, j) in enumerate(zip(algorithm.left.tolist(), algorithm.right.tolist(), strict=True)):
        t, v = torch.randn(d, generator=gen), torch.randn(d, generator=gen)
        theta[i, j], theta[j, i], dual[i, j], dual[j, i] = t, -t, v, -v
        server["theta"][p], server["dual"][p] = t, v
        server["spread"][i] += t - v
        server["spread"][j] -= t - v
    server["omega"] = omega.clone()
    active = [1, 3, 4]
    uploads = {i: torch.randn(d, generator=gen) for i in active}
    results = []
    for i in active:
        tree = algorithm.table_tree(uploads[i].unsqueeze(0), params)
        upload = {"params": {k: v[0] for k, v in tree.items()}}
        results.append(ClientResult(upload, 1.0, 0.0, client_id=i))
    new = algorithm.aggregate(server, results)
    for i in active:
        omega[i] = uploads[i]
    for i in range(m):
        for j in range(i + 1, m):
            both = i in active and j in active
            if both or (pairs == "touching" and (i in active or j in active)):
                delta = omega[i] - omega[j] + dual[i, j] / RHO
                theta[i, j] = scad_prox(delta.unsqueeze(0), LAM, A, XI, RHO)[0]
                dual[i, j] = dual[i, j] + RHO * (omega[i] - omega[j] - theta[i, j])
                theta[j, i], dual[j, i] = -theta[i, j], -dual[i, j]
    zeta = torch.stack([(omega + theta[i] - dual[i] / RHO).mean(dim=0) for i in range(m)])
    assert torch.allclose(new["zeta"], zeta, atol=1e-5, rtol=0)
    for p, (i, j) in enumerate(zip(algorithm.left.tolist(), algorithm.right.tolist(), strict=True)):
        assert torch.allclose(new["theta"][p], theta[i, j], atol=1e-6, rtol=0)
        assert torch.allclose(new["dual"][p], dual[i, j], atol=1e-6, rtol=0)
    message = algorithm.server_message(new)
    assert algorithm.wire.download_bytes(message, [0]) == num_bytes(params)  # one zeta_i
    assert algorithm.wire.download_bytes(message, [0, 2]) == 2 * num_bytes(params)
    assert num_bytes(message["zeta"]) == m * num_bytes(params)  # the table held in memory


def test_connected_components():
    assert connected_components(5, [(3, 4), (0, 2)]) == [[0, 2], [1], [3, 4]]
    assert connected_components(3, []) == [[0], [1], [2]]


# -- FPFC: planted clusters ----------------------------------------------------------------------


def planted_clusters(per_cluster: int = 4, dim: int = 5, n: int = 60, seed: int = 0):
    """Clients drawn from 3 linear models (pairwise 5.0, 6.6 and 7.8 apart), targets with noise
    0.1; the logreg model on float targets is linear least squares."""
    rng = np.random.default_rng(seed)
    centers = [rng.normal(0, 2, dim + 1) for _ in range(3)]
    train, test, labels = [], [], []
    for label, w in enumerate(centers):
        for _ in range(per_cluster):
            x = rng.normal(0, 1, (n, dim)).astype(np.float32)
            y = (x @ w[:-1] + w[-1] + 0.1 * rng.normal(0, 1, n)).astype(np.float32)
            xt = rng.normal(0, 1, (20, dim)).astype(np.float32)
            train.append((x, y))
            test.append((xt, (xt @ w[:-1] + w[-1]).astype(np.float32)))
            labels.append(label)
    return fedloom.data.from_arrays(train=train, test=test), labels


@pytest.mark.parametrize(
    "extra, train",
    [
        ({}, {"rounds": 50}),
        ({}, {"rounds": 100, "clients_per_round": 6}),
        ({"pairs": "touching", "deploy": "cluster"}, {"rounds": 100, "clients_per_round": 6}),
    ],
    ids=["full", "partial", "touching-cluster"],
)
def test_fpfc_recovers_planted_clusters(servers, extra, train):
    """The 3 planted groups are found exactly (adjusted Rand index 1.0): measured within-cluster
    ||theta_ij|| <= 7.6e-5 / 8.8e-5 / 9.1e-5 (under the default threshold xi = 1e-4: the prox
    maps the pairs it fuses into that ball), across clusters >= 5.03; personalized test MSE
    1.16e-4 / 1.18e-4 / 1.16e-4, the 4-client fits (local least squares alone: 7.6e-4)."""
    data, labels = planted_clusters()
    config = {
        "seed": 0,
        "model": {"name": "logreg"},
        "algorithm": {"name": "fpfc", **extra},
        "train": {"lr": 0.1, "batch_size": None, "local_steps": 10, **train},
        "eval": {"every": train["rounds"]},
        "executor": {"kind": "sequential"},
    }
    result = fedloom.run(config, data=data, write=False, progress=False)
    algorithm, server = servers[-1]
    found = algorithm.clusters(server)
    predicted = [next(c for c, members in enumerate(found) if k in members) for k in range(12)]
    assert adjusted_rand_score(labels, predicted) == 1.0
    extras = algorithm.summary_extras(server)
    assert extras["num_clusters"] == 3 and extras["clusters"] == found
    assert result.summary["extras"] == extras == result.extras  # summary.json reports them
    # each sampled client downloads its own zeta_i: one model's bytes, not the m-row table
    model_bytes = num_bytes(result.client_params[0])
    per_round = train.get("clients_per_round", 12)
    expected = train["rounds"] * per_round * model_bytes
    assert result.summary["communication"]["bytes_down"] == expected
    # the running sums sum_j (theta_ij - v_ij / rho), updated pair by pair, match a recount
    # (float64: measured equal, 0.0 apart, after 100 rounds)
    u = server["theta"].double() - server["dual"].double() / algorithm.config.rho
    recount = torch.zeros_like(server["spread"]).index_add_(0, algorithm.left, u)
    recount.index_add_(0, algorithm.right, u, alpha=-1.0)
    assert torch.allclose(server["spread"], recount, atol=1e-10, rtol=0)
    assert result.summary["final"]["global"] is None
    assert result.summary["final"]["personalized"]["loss_mean"] < 3e-4
    if extra.get("deploy") == "cluster":
        for members in found:
            first = result.client_params[members[0]]
            for k in members[1:]:
                for key, value in first.items():
                    assert torch.equal(value, result.client_params[k][key])


@pytest.mark.parametrize(
    "raw, key",
    [
        ({"name": "fpfc", "a": 2.0}, "algorithm.a"),
        ({"name": "fpfc", "rho": 0.0}, "algorithm.rho"),
        ({"name": "fpfc", "xi": 0.7}, "xi must be smaller than lam"),
        ({"name": "fpfc", "rho": 0.3}, "rho must exceed"),
        ({"name": "fpfc", "pairs": "all"}, "algorithm.pairs"),
        ({"name": "fpfc", "threshold": -1.0}, "algorithm.threshold"),
    ],
)
def test_invalid_hyperparameters_name_the_key(raw, key):
    assert raw["name"] in ALGORITHMS.names()
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        parse_algorithm_config(raw)


@pytest.mark.slow
def test_fpfc_personalizes_and_clusters_label_shards(servers):
    # Measured (BASE setup, 20 rounds, 10 of 20 clients a round): personalized mean 0.913,
    # P10 0.784, no global model (deploy: cluster gives 0.933 / 0.856); FedAvg's global model
    # on the same clients: 0.6215. The 5 label pairs are the true groups: FPFC finds 8
    # clusters, each inside one group (3 groups exact, 2 split in 2 and 3), adjusted Rand
    # index 0.82.
    result = run_pfl({"name": "fpfc"})
    personalized = result.summary["final"]["personalized"]["accuracy_mean"]
    assert personalized > fedavg_accuracy_on_clients() + 0.2
    config = parse_config(pfl_config({"name": "fpfc"}))
    data = load_dataset(config.data, config.seed)
    pairs = [tuple(sorted(set(c.y_train.tolist()))) for c in data.clients]
    group = [sorted(set(pairs)).index(p) for p in pairs]
    algorithm, server = servers[-1]
    found = algorithm.clusters(server)
    assert all(len({group[k] for k in members}) == 1 for members in found), found
    predicted = [next(c for c, members in enumerate(found) if k in members) for k in range(20)]
    assert adjusted_rand_score(group, predicted) > 0.7
