"""FedProto (Tan et al., AAAI 2022, arXiv:2105.00243): the prototype aggregation against class
means computed directly, the local objective and the repel term against hand-written ones, the
reduction lam = 0 (local-only training), the bytes, new clients, resume, configuration errors,
and learning on the shared Fashion-MNIST shards setup."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import fedloom
from fedloom.algorithms import ClientTask, build_algorithm
from fedloom.algorithms.client import client_program
from fedloom.algorithms.fedproto import prototype_loss
from fedloom.config import parse_config
from fedloom.core.functional import FunctionalModel
from fedloom.data.load import load_dataset
from fedloom.errors import ConfigError
from fedloom.models import MLP
from fedloom.solvers.sequential import run_client
from tests.algorithms.pfl_setup import fedavg_accuracy_on_clients, run_pfl
from tests.algorithms.tiny_2nn_setup import (
    CLASSES,
    HELD,
    HIDDEN,
    client_data,
    digits_config,
    features,
    logits,
    make_ctx,
    max_difference,
    run,
)
from tests.resume import killed_and_resumed


# -- FedProto: the prototypes --------------------------------------------------------------
@pytest.mark.parametrize("weighting", ["samples", "uniform"])
def test_fedproto_global_prototypes_are_the_weighted_class_means(weighting):
    datas = [client_data(labels, seed=c) for c, labels in enumerate(HELD)]
    ctx = make_ctx({c: d.num_train for c, d in enumerate(datas)}, batch_size=4)
    algo = build_algorithm({"name": "fedproto", "weighting": weighting}, ctx)
    server = algo.init_server_state(*ctx.model.initial_state(0))
    # last round's table: classes 0 and 7 have prototypes, 7 is held by nobody this round
    old = torch.randn(CLASSES, HIDDEN, generator=torch.Generator().manual_seed(9))
    server["protos"], server["known"][[0, 7]] = old.clone(), True
    message = algo.server_message(server)
    assert message["protos"]["ids"].tolist() == [0, 7]
    results = []
    for c, data in enumerate(datas):
        task = ClientTask(c, data, ctx.make_plan(data, 5, "batches", 1, c), 0.1, 1)
        results.append(
            run_client(client_program(algo), message, algo.init_client_state(server, c), task)
        )
    new = algo.aggregate(server, results)

    sums, counts, means = torch.zeros(CLASSES, HIDDEN), torch.zeros(CLASSES), []
    for r, data in zip(results, datas, strict=True):
        h = features(r.state["params"], data.x_train)  # the trained model, by hand
        up = r.upload["protos"]
        held = sorted(set(data.y_train.tolist()))
        assert up["ids"].tolist() == held
        assert up["count"].tolist() == [int((data.y_train == j).sum()) for j in held]
        own = {}
        for row, j in enumerate(held):
            rows = h[data.y_train == j]
            own[j] = rows.mean(0)
            sums[j] += rows.sum(0)
            counts[j] += rows.shape[0]
            assert torch.allclose(up["mean"][row], own[j], atol=1e-6)
        means.append(own)
    for j in range(CLASSES):
        if j in (4, 6, 7):  # reported by nobody: last round's value (7) or still unknown
            assert torch.equal(new["protos"][j], old[j]), j
            assert bool(new["known"][j]) == (j == 7)
            continue
        if weighting == "samples":  # sum_k |D_kj| C_k^j / sum_k |D_kj|: the pooled class mean
            expected = sums[j] / counts[j]
        else:  # 1/|reporters of j| sum_k C_k^j
            expected = torch.stack([own[j] for own in means if j in own]).mean(0)
        assert torch.allclose(new["protos"][j], expected, atol=1e-6), j
        assert bool(new["known"][j])
    # the weighting matters here: class 2's counts are 3, 1 and 3 with different means
    pooled = sums[2] / counts[2]
    uniform = torch.stack([own[2] for own in means]).mean(0)
    assert (pooled - uniform).abs().max() > 1e-3


def test_fedproto_local_step_is_ce_plus_lam_times_the_mse_to_the_global_prototypes():
    data = client_data([0, 1, 1, 2, 3, 3], seed=4)  # class 3 has no global prototype
    ctx = make_ctx({0: data.num_train})
    lam, lr = 2.5, 0.1
    algo = build_algorithm({"name": "fedproto", "lam": lam}, ctx)
    server = algo.init_server_state(*ctx.model.initial_state(0))
    gen = torch.Generator().manual_seed(2)
    server["protos"] = torch.rand(CLASSES, HIDDEN, generator=gen)
    server["known"][[0, 1, 2, 5]] = True
    state = algo.init_client_state(server, 0)
    task = ClientTask(0, data, [torch.arange(data.num_train)], lr, 1)  # one full-batch step
    result = run_client(client_program(algo), algo.server_message(server), state, task)

    leaves = {k: v.clone().requires_grad_(True) for k, v in state["params"].items()}
    h = features(leaves, data.x_train)
    targets = server["protos"][data.y_train]
    has = (data.y_train != 3).float()[:, None]
    mse = (((h - targets) * has) ** 2).sum() / (data.num_train * HIDDEN)
    loss = F.cross_entropy(logits(leaves, data.x_train), data.y_train) + lam * mse
    grads = torch.autograd.grad(loss, list(leaves.values()))
    assert result.loss == pytest.approx(float(loss.detach()), rel=1e-6)
    for (k, p), g in zip(leaves.items(), grads, strict=True):
        # measured: 3.0e-8
        assert torch.allclose(result.state["params"][k], p.detach() - lr * g, atol=1e-6), k


def test_fedproto_repel_is_a_bounded_hinge_computed_by_hand():
    h = torch.tensor([[0.0, 0.0], [1.0, 1.0], [3.0, 0.0]])
    y = torch.tensor([0, 1, 2])
    table = torch.tensor([[0.5, 0.0], [1.0, 2.0], [0.0, 0.0], [9.0, 9.0]])
    known = torch.tensor([True, True, False, True])  # sample 2's class is unknown
    pull, push = prototype_loss(h, y, table, known, repel=1.0, margin=1.0)
    d = ((h[:, None, :] - table[None]) ** 2).mean(-1)  # per-dimension squared distances
    assert pull == pytest.approx((0.25 + 0 + 1.0) / (3 * 2))
    hinge = 0.0
    for n, j in [(0, 1), (0, 3), (1, 0), (1, 3)]:  # known own class, known other classes
        hinge += max(0.0, 1.0 + float(d[n, y[n]]) - float(d[n, j]))
    assert float(push) == pytest.approx(hinge / 3)
    assert float(push) > 0
    # every other prototype more than the margin farther than the own one: exactly 0
    spread = torch.tensor([[0.0, 0.0], [10.0, 0.0], [5.0, 5.0], [-9.0, -9.0]])
    _, far = prototype_loss(spread[:2] + 0.1, y[:2], spread, known, repel=1.0, margin=1.0)
    assert float(far) == 0.0
    _, off = prototype_loss(h, y, table, known)
    assert float(off) == 0.0


def test_fedproto_with_lam_zero_trains_like_local_only():
    plain = run({"name": "local"}, stragglers=0.3)
    proto = run({"name": "fedproto", "lam": 0.0}, stragglers=0.3)
    # measured: bit-identical (same plans, same lean trainer, the term is skipped)
    assert max_difference(plain, proto) == 0.0
    regularized = run({"name": "fedproto", "lam": 1.0}, stragglers=0.3)
    # measured: 3.0e-3 (the prototype term acts once a client trains after round 1)
    assert max_difference(plain, regularized) > 3e-4


def test_fedproto_bytes_count_only_prototypes_and_counts():
    config = digits_config({"name": "fedproto"}, clients_per_round=None, stragglers=0.0)
    cfg = parse_config(config)
    data = load_dataset(cfg.data, cfg.seed)
    result = fedloom.run(config, data=data, write=False, progress=False)
    held = [len(set(data.clients[c].y_train.tolist())) for c in range(5)]  # 5 is held out
    known = len(set().union(*(set(data.clients[c].y_train.tolist()) for c in range(5))))
    d = 200
    comm = result.summary["communication"]
    # up: per held class its id (int64), prototype (d float32) and count (int64), every round
    assert comm["bytes_up"] == 4 * sum(held) * (8 + 4 * d + 8)
    # down: nothing in round 1, then the known classes' ids and prototypes to 5 clients
    assert comm["bytes_down"] == 3 * 5 * known * (8 + 4 * d)
    model = sum(p.numel() * 4 for p in MLP((1, 8, 8), 10).parameters())
    assert comm["bytes_up"] < 4 * 5 * model / 50


def test_fedproto_clients_keep_their_models_and_a_new_client_gets_the_initial_one():
    result = run({"name": "fedproto"})
    assert result.global_params is None and result.summary["final"]["global"] is None
    init, _ = FunctionalModel(MLP((1, 8, 8), 10), "classification").initial_state(3)
    new = 5  # the held-out client: the initial model, then fine-tuned by the cold start
    for key, value in init.items():
        assert torch.equal(result.client_params[new][key], value), key
    trained = [
        c
        for c in range(5)
        if not torch.equal(result.client_params[c]["fc3.weight"], init["fc3.weight"])
    ]
    assert len(trained) >= 3
    curve = result.summary["cold_start"]
    assert curve["clients"] == 1 and len(curve["steps"]) > 1


def test_fedproto_killed_and_resumed_equals_uninterrupted(tmp_path):
    # the server state holds the prototype table, the client states whole models
    config = digits_config({"name": "fedproto"}, rounds=4, stragglers=0.3)
    config["checkpoint"] = {"every": 2}
    config["eval"] = {"every": 2, "new_clients": 1}
    killed_and_resumed(config, tmp_path, crash_round=3)


@pytest.mark.parametrize(
    ("algorithm", "key"),
    [
        ({"name": "fedproto", "lam": -1.0}, "algorithm.lam"),
        ({"name": "fedproto", "weighting": "size"}, "algorithm.weighting"),
        ({"name": "fedproto", "repel": -0.1}, "algorithm.repel"),
    ],
)
def test_invalid_hyperparameters_name_the_key(algorithm, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        run(algorithm)


# -- learning on the shared personalized setup (tests/algorithms/pfl_setup.py) -------------
@pytest.mark.slow
def test_fedproto_beats_fedavg_on_label_shards(data_root):
    # Measured (seed 0): personalized mean 0.9588, P10 0.920 (local-only: 0.957); FedAvg's
    # global model on the same clients 0.6215.
    result = run_pfl({"name": "fedproto"})
    accuracy = result.summary["final"]["personalized"]["accuracy_mean"]
    assert accuracy >= fedavg_accuracy_on_clients() + 0.30, accuracy
