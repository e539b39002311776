"""FedGH (Yi et al., ACM MM 2023, arXiv:2303.13137): the upload against class means of the body
computed by hand, the server's header training against plain torch SGD, the reduction
server_epochs = 0 (LG-FedAvg's first round, a header that never moves), that the header really
trains, refusals, and learning on the shared Fashion-MNIST shards setup."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F

import fedloom
from fedloom.algorithms import ClientTask, build_algorithm
from fedloom.algorithms.base import ClientResult
from fedloom.algorithms.client import client_program
from fedloom.core.rng import generator
from fedloom.errors import ConfigError
from fedloom.solvers.sequential import run_client
from tests.algorithms.digits_setup import BODY, HEAD, TRAINED, digits_config, initial_params
from tests.algorithms.digits_setup import run_digits as run
from tests.algorithms.pfl_setup import fedavg_accuracy_on_clients, run_pfl
from tests.algorithms.tiny_2nn_setup import HELD, client_data, features, make_ctx
from tests.resume import killed_and_resumed


def test_fedgh_uploads_class_means_of_the_trained_body_and_keeps_the_body():
    ctx = make_ctx({0: 6, 1: 7, 2: 9}, batch_size=3)
    algo = build_algorithm({"name": "fedgh"}, ctx)
    server = algo.init_server_state(*ctx.model.initial_state(0))
    state = algo.init_client_state(server, 1)
    data = client_data(HELD[1], seed=1)
    plan = ctx.make_plan(data, 4, "batches", 0, 1)
    result = run_client(
        client_program(algo), algo.server_message(server), state, ClientTask(1, data, plan, 0.1, 0)
    )
    params = {**result.state["params"], **server["params"]}
    assert sorted(result.state["params"]) == sorted(k for k in params if not k.startswith("fc3"))
    up = result.upload["protos"]
    assert up["ids"].tolist() == [1, 2, 3] and up["count"].tolist() == [1, 1, 5]
    # the trained model's body (the head is the client's trained one, never uploaded)
    h = features(result.state["params"], data.x_train)
    for row, c in enumerate([1, 2, 3]):
        assert torch.allclose(up["mean"][row], h[data.y_train == c].mean(0), atol=1e-6)
    assert sorted(result.upload) == ["protos"] and result.weight == 7.0


def test_fedgh_server_trains_the_header_by_sgd_on_the_prototypes():
    ctx = make_ctx({0: 6, 1: 7, 2: 9}, batch_size=3)
    cfg = {"name": "fedgh", "server_lr": 0.5, "server_epochs": 3, "server_batch_size": 2}
    algo = build_algorithm(cfg, ctx)
    server = algo.init_server_state(*ctx.model.initial_state(0))
    gen = torch.Generator().manual_seed(1)
    ups = [
        {"ids": torch.tensor([0, 2]), "mean": torch.rand(2, 6, generator=gen)},
        {"ids": torch.tensor([1, 2, 5]), "mean": torch.rand(3, 6, generator=gen)},
    ]
    results = [
        ClientResult({"protos": u}, 1.0, 0.0, client_id=i, round=4) for i, u in enumerate(ups)
    ]
    new = algo.aggregate(server, results)
    # by hand: nn.Linear and torch.optim.SGD on the same shuffles of the five pairs
    x = torch.cat([u["mean"] for u in ups])
    y = torch.tensor([0, 2, 1, 2, 5])
    linear = torch.nn.Linear(6, 8)
    with torch.no_grad():
        linear.weight.copy_(server["params"]["fc3.weight"])
        linear.bias.copy_(server["params"]["fc3.bias"])
    opt = torch.optim.SGD(linear.parameters(), lr=0.5)
    shuffles = generator(0, "fedgh/header", 4)
    for _ in range(3):
        order = torch.randperm(5, generator=shuffles)
        for start in (0, 2, 4):
            idx = order[start : start + 2]
            opt.zero_grad()
            F.cross_entropy(linear(x[idx]), y[idx]).backward()
            opt.step()
    assert torch.allclose(new["params"]["fc3.weight"], linear.weight, atol=1e-6)
    assert torch.allclose(new["params"]["fc3.bias"], linear.bias, atol=1e-6)
    assert (new["params"]["fc3.weight"] - server["params"]["fc3.weight"]).abs().max() > 1e-2
    assert new["initial_local"] is server["initial_local"]


def test_fedgh_without_server_epochs_is_lgfedavg_with_a_frozen_header():
    # round 1 of both: [initial body, initial head], the same local SGD on the same plans
    fedgh = run({"name": "fedgh", "server_epochs": 0}, rounds=1)
    lg = run({"name": "lgfedavg"}, rounds=1)
    init = initial_params()
    for c in TRAINED:
        for key in BODY:
            assert torch.equal(fedgh.client_params[c][key], lg.client_params[c][key]), (c, key)
    # FedGH's header never moved; LG-FedAvg's head is the clients' average
    for c in TRAINED:
        for key in HEAD:
            assert torch.equal(fedgh.client_params[c][key], init[key]), (c, key)
    assert (lg.client_params[0]["fc3.weight"] - init["fc3.weight"]).abs().max() > 1e-3


def test_fedgh_header_is_trained_and_shared_by_every_client():
    result = run({"name": "fedgh"}, clients_per_round=None)
    lg = run({"name": "lgfedavg"}, clients_per_round=None)
    head = result.client_params[0]["fc3.weight"]
    for c in TRAINED:
        assert torch.equal(result.client_params[c]["fc3.weight"], head), c
    # measured: 0.020 from LG-FedAvg's averaged head, 0.0078 from the initial one
    assert (head - lg.client_params[0]["fc3.weight"]).abs().max() > 5e-3
    assert (head - initial_params()["fc3.weight"]).abs().max() > 2e-3
    comm = result.summary["communication"]
    head_bytes = 4 * (10 * 200 + 10)
    assert comm["bytes_down"] == 3 * 5 * head_bytes  # the header to 5 clients, 3 rounds


@pytest.mark.parametrize(
    ("algorithm", "key"),
    [
        ({"name": "fedgh", "server_lr": 0.0}, "algorithm.server_lr"),
        ({"name": "fedgh", "server_epochs": -1}, "algorithm.server_epochs"),
        ({"name": "fedgh", "server_batch_size": 0}, "algorithm.server_batch_size"),
        ({"name": "fedgh", "weighting": "samples"}, "algorithm.weighting"),
    ],
)
def test_invalid_hyperparameters_name_the_key(algorithm, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        run(algorithm)


def test_fedgh_refuses_sample_dp():
    config = digits_config({"name": "fedgh"})
    config["privacy"] = {"kind": "sample_dp", "noise_multiplier": 1.0, "clip": 1.0}
    with pytest.raises(ConfigError, match="sample_dp"):
        fedloom.run(config, write=False, progress=False)


# -- learning on the shared personalized setup (tests/algorithms/pfl_setup.py) -------------
@pytest.mark.slow
@pytest.mark.heavy(budget=90)
def test_fedgh_beats_fedavg_on_label_shards(data_root):
    # Measured (seed 0): personalized mean 0.9554, P10 0.907 (25 s on a shared machine);
    # FedAvg's global model on the same clients 0.6215.
    result = run_pfl({"name": "fedgh"})
    accuracy = result.summary["final"]["personalized"]["accuracy_mean"]
    assert accuracy >= fedavg_accuracy_on_clients() + 0.20, accuracy


def test_fedgh_killed_and_resumed_equals_uninterrupted(tmp_path):
    # the server state holds the header, the client states the bodies
    config = digits_config({"name": "fedgh"}, rounds=4, stragglers=0.3)
    config["checkpoint"] = {"every": 2}
    config["eval"] = {"every": 2, "new_clients": 1}
    killed_and_resumed(config, tmp_path, crash_round=3)
