"""The monitoring measurements (engine/monitoring.py) against hand computations on tiny
problems, and what the engine records per evaluated round."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import fedloom
from fedloom.config import parse_config
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.data import load_dataset
from fedloom.engine.monitoring import (
    feature_js,
    gradient_dissimilarity,
    label_kl,
    quantiles,
    update_statistics,
)
from fedloom.models import LogisticRegression


def test_quantiles_match_numpy():
    values = [0.3, 1.7, 0.2, 5.0, 2.2, 0.9, 1.1]
    q = quantiles(values)
    assert q["p10"] == pytest.approx(np.percentile(values, 10))
    assert q["p50"] == pytest.approx(np.median(values))
    assert q["p90"] == pytest.approx(np.percentile(values, 90))
    assert (q["min"], q["max"], q["mean"]) == (0.2, 5.0, pytest.approx(np.mean(values)))
    assert quantiles([])["p50"] is None


def test_update_norms_and_cosine_by_hand():
    deltas = {
        3: {"w": torch.tensor([3.0, 0.0]), "b": torch.tensor([4.0])},  # (3, 0, 4): norm 5
        1: {"w": torch.tensor([0.0, 1.0]), "b": torch.tensor([0.0])},  # (0, 1, 0): norm 1
        2: {"w": torch.tensor([-3.0, 0.0]), "b": torch.tensor([-4.0])},  # -(3, 0, 4)
        5: {"w": torch.zeros(2), "b": torch.zeros(1)},  # no movement: cosine undefined
    }
    stats = update_statistics(deltas, max_clients=3)
    assert stats["client_update_norm"] == {"1": 1.0, "2": 5.0, "3": 5.0, "5": 0.0}
    assert stats["update_norm"]["max"] == 5.0 and stats["update_norm"]["min"] == 0.0
    cosine = stats["cosine"]
    assert cosine["clients"] == [1, 2, 3]  # the first max_clients by id
    m = np.array(cosine["matrix"])
    # flattened in key order (b, w): client 1 = (0, 0, 1), 2 = (-4, -3, 0), 3 = (4, 3, 0)
    assert m[0, 0] == pytest.approx(1.0) and m[1, 2] == pytest.approx(-1.0)
    assert m[0, 1] == pytest.approx(0.0) and m[0, 2] == pytest.approx(0.0)
    assert np.allclose(m, m.T)
    zero = update_statistics({0: deltas[1], 5: deltas[5]}, 4)["cosine"]["matrix"]
    assert zero[0][1] is None and zero[1][1] is None


def test_gradient_dissimilarity_is_the_weighted_spread_of_client_gradients():
    torch.manual_seed(0)
    model = FunctionalModel(LogisticRegression((3,), 1), "regression")
    params, buffers = model.initial_state(0)
    clients = {}
    for c, n in enumerate([5, 9, 14]):
        x = torch.randn(n, 3) + c
        clients[c] = ClientData(x, x @ torch.tensor([1.0, -2.0, 0.5]) + c, x[:0], x[:0, 0])
    zeta = gradient_dissimilarity(model, params, buffers, clients)
    # by hand: least squares loss mean (w.x + b - y)^2, gradient 2/n X^T r
    w, b = params["linear.weight"].reshape(-1), params["linear.bias"]
    grads, sizes = [], []
    for data in clients.values():
        r = data.x_train @ w + b - data.y_train
        n = len(r)
        grads.append(torch.cat([2 / n * data.x_train.T @ r, (2 / n * r.sum()).reshape(1)]))
        sizes.append(n)
    g = torch.stack(grads).double()
    mean = (torch.tensor(sizes, dtype=torch.float64)[:, None] * g).sum(0) / sum(sizes)
    expected = float(((g - mean) ** 2).sum(1).mean())
    assert zeta == pytest.approx(expected, rel=1e-5)
    # identical clients: no dissimilarity
    same = {c: clients[0] for c in range(3)}
    assert gradient_dissimilarity(model, params, buffers, same) == pytest.approx(0.0, abs=1e-10)


def test_label_kl_by_hand():
    def client(labels):
        y = torch.tensor(labels)
        return ClientData(torch.zeros(len(y), 2), y, torch.zeros(0, 2), y[:0])

    clients = {0: client([0, 0, 0, 1]), 1: client([1, 1, 2, 2])}
    kl = label_kl(clients, num_classes=3)
    pooled = np.array([3, 3, 2]) / 8
    p0, p1 = np.array([0.75, 0.25]), np.array([0.5, 0.5])
    assert kl["0"] == pytest.approx(float((p0 * np.log(p0 / pooled[:2])).sum()))
    assert kl["1"] == pytest.approx(float((p1 * np.log(p1 / pooled[1:])).sum()))
    assert label_kl({0: client([0, 1, 2])}, 3)["0"] == pytest.approx(0.0, abs=1e-12)


def test_feature_js_by_hand_for_tokens_and_zero_for_identical_inputs():
    def client(tokens):
        x = torch.tensor(tokens)
        return ClientData(x[:, None], x, x[:0, None], x[:0])

    js = feature_js({0: client([0, 0]), 1: client([1, 1])})
    # P0 = (1, 0), P1 = (0, 1), pooled (1/2, 1/2): JS(P0, pooled) = 1/2 KL(P0||M) + 1/2 KL(M||M)
    m = np.array([0.75, 0.25])
    expected = 0.5 * (1.0 * math.log2(1.0 / 0.75)) + 0.5 * float(
        (np.array([0.5, 0.5]) * np.log2(np.array([0.5, 0.5]) / m)).sum()
    )
    assert js["0"] == pytest.approx(expected) and js["1"] == pytest.approx(expected)
    x = torch.rand(20, 4)
    same = feature_js({c: ClientData(x, x[:, 0], x[:0], x[:0, 0]) for c in range(3)})
    assert all(v == pytest.approx(0.0, abs=1e-12) for v in same.values())


def digits(algorithm: str, **monitor) -> dict:
    return {
        "seed": 0,
        "data": {
            "name": "digits",
            "num_clients": 6,
            "partition": {"kind": "dirichlet", "alpha": 0.3},
        },
        "model": {"name": "mlp"},
        "algorithm": {"name": algorithm},
        "train": {"rounds": 4, "clients_per_round": 3, "local_steps": 5, "batch_size": 32},
        "eval": {"every": 2},
        "monitor": monitor,
    }


def test_engine_records_health_every_evaluated_round(tmp_path):
    result = fedloom.run(digits("fedavg"), out=tmp_path / "run", progress=False)
    rows = result.history
    assert [r["round"] for r in rows] == [2, 4]
    for row in rows:
        health = row["monitor"]
        assert len(health["client_update_norm"]) == 3  # the round's reporting clients
        assert health["update_norm"]["max"] >= health["update_norm"]["p50"] > 0
        assert len(health["cosine"]["matrix"]) == 3
        assert health["zeta2"] > 0
        assert row["seconds"]["round"] > 0 and row["seconds"]["monitor"] > 0
        comm = row["communication"]  # every round sends the same: total = round x per round
        assert comm["bytes_up_round"] * row["round"] == comm["bytes_up"] > 0
    het = json.loads((tmp_path / "run" / "heterogeneity.json").read_text())
    assert set(het) == {"label_kl", "feature_js", "test_samples"} and len(het["label_kl"]) == 6
    # what each client's personalized accuracy is measured on (the collapse alert's minimum)
    data = load_dataset(parse_config(digits("fedavg")).data, 0)
    assert het["test_samples"] == {str(c): d.num_test for c, d in enumerate(data.clients)}
    assert len(set(het["test_samples"].values())) > 1  # dirichlet: unequal sizes
    summary = result.summary["heterogeneity"]
    assert summary["zeta2_last"] == rows[-1]["monitor"]["zeta2"]
    assert summary["label_kl_mean"] == pytest.approx(np.mean(list(het["label_kl"].values())))


def test_update_norm_is_the_distance_the_client_moved():
    # one reporting client, FedAvg with one client per round: the global model after the
    # round is that client's model, so ||Delta|| = ||w_after - w_before||
    cfg = digits("fedavg")
    cfg["train"].update(rounds=2, clients_per_round=1)
    cfg["eval"]["every"] = 1
    rows = fedloom.run(cfg, write=False, progress=False).history
    before = fedloom.run(
        {**cfg, "train": {**cfg["train"], "rounds": 1}}, write=False, progress=False
    )
    after = fedloom.run(cfg, write=False, progress=False)
    moved = torch.cat(
        [
            (after.global_params[k] - before.global_params[k]).reshape(-1).double()
            for k in sorted(after.global_params)
        ]
    ).norm()
    assert rows[1]["monitor"]["update_norm"]["max"] == pytest.approx(float(moved), rel=1e-6)


def test_monitoring_off_records_nothing():
    result = fedloom.run(digits("fedavg", enabled=False), write=False, progress=False)
    assert all("monitor" not in row for row in result.history)
    assert "heterogeneity" not in result.summary


def test_algorithms_without_a_global_model_get_no_zeta():
    rows = fedloom.run(digits("local"), write=False, progress=False).history
    assert "zeta2" not in rows[-1]["monitor"]


def test_privacy_spend_is_recorded_when_a_mechanism_accounts_it():
    """The evaluated rows carry the budget the run's DP mechanism has spent so far."""
    private = {**digits("fedavg"), "privacy": {"kind": "client_dp", "noise_multiplier": 1.0}}
    rows = fedloom.run(private, write=False, progress=False).history
    spent = [row["privacy"]["epsilon"] for row in rows]
    assert 0 < spent[0] < spent[1]
    plain = fedloom.run(digits("fedavg"), write=False, progress=False).history
    assert "privacy" not in plain[0]
