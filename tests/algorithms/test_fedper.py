"""FedPer (Arivazhagan et al., 2019, arXiv:1912.00818): the body/head split, the server's
sample-weighted average of the bodies, the bytes, new clients fine-tuning their head,
configuration errors, and learning on the shared Fashion-MNIST shards setup."""

from __future__ import annotations

import re

import pytest
import torch

import fedloom
from fedloom.algorithms import ClientResult, build_algorithm
from fedloom.core.functional import FunctionalModel
from fedloom.errors import ConfigError
from fedloom.models import MLP
from tests.algorithms.digits_setup import BODY, HEAD, digits_config
from tests.algorithms.digits_setup import digits_ctx as make_ctx
from tests.algorithms.digits_setup import run_digits as run
from tests.algorithms.pfl_setup import fedavg_accuracy_on_clients, run_pfl


# -- FedPer ---------------------------------------------------------------------------------
def test_fedper_bodies_are_shared_and_heads_personal():
    result = run({"name": "fedper"})
    trained = list(range(5))  # client 5 is the held-out new client
    models = result.client_params
    for key in BODY:
        for c in [*trained, 5]:
            assert torch.equal(models[c][key], models[0][key]), (c, key)
    # each trained head is its own; the new client deploys the initial head
    init, _ = FunctionalModel(MLP((1, 8, 8), 10), "classification").initial_state(3)
    heads = [torch.cat([models[c][k].flatten() for k in HEAD]) for c in trained]
    for i in range(len(heads)):
        for j in range(i + 1, len(heads)):
            assert (heads[i] - heads[j]).abs().max() > 1e-3, (i, j)
    for key in HEAD:
        assert torch.equal(models[5][key], init[key])
    assert result.global_params is None and result.summary["final"]["global"] is None


def test_fedper_server_averages_bodies_with_sample_weights():
    ctx = make_ctx()
    algo = build_algorithm({"name": "fedper"}, ctx)
    params, buffers = ctx.model.initial_state(0)
    server = algo.init_server_state(params, buffers)
    assert sorted(algo.server_message(server)["params"]) == sorted(BODY)
    gen = torch.Generator().manual_seed(1)
    bodies = [{k: torch.randn(v.shape, generator=gen) for k, v in server["params"].items()}]
    bodies.append({k: torch.randn(v.shape, generator=gen) for k, v in server["params"].items()})
    results = [
        ClientResult({"params": b, "buffers": {}}, ctx.objective_weight(c, "samples"), 0.0)
        for c, b in zip([0, 1], bodies, strict=True)
    ]
    new = algo.aggregate(server, results)
    n0, n1 = ctx.population[0], ctx.population[1]
    for k in BODY:
        expected = (n0 * bodies[0][k] + n1 * bodies[1][k]) / (n0 + n1)
        assert torch.allclose(new["params"][k], expected, atol=1e-6)
    assert sorted(new["params"]) == sorted(BODY)


def test_fedper_bytes_count_only_the_body():
    result = run({"name": "fedper"}, stragglers=0.0)
    model = MLP((1, 8, 8), 10)
    body = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n in BODY)
    comm = result.summary["communication"]
    assert comm["bytes_up"] == 3 * 3 * body  # rounds x reporters x body bytes
    assert comm["bytes_down"] == 3 * 3 * body


def test_fedper_new_client_finetunes_its_head_only():
    plain = run({"name": "fedper"})
    tuned = run({"name": "fedper", "finetune_steps": 10})
    new = 5
    for key in BODY:
        assert torch.equal(tuned.client_params[new][key], plain.client_params[new][key])
    assert (
        tuned.client_params[new]["fc3.weight"] - plain.client_params[new]["fc3.weight"]
    ).abs().max() > 1e-4
    # trained clients are unaffected by the option
    for key in [*BODY, *HEAD]:
        assert torch.equal(tuned.client_params[0][key], plain.client_params[0][key])
    assert (
        tuned.summary["final"]["new_clients"]["accuracy_mean"]
        > plain.summary["final"]["new_clients"]["accuracy_mean"]
    )


@pytest.mark.parametrize(
    ("algorithm", "key"),
    [
        ({"name": "fedper", "finetune_steps": -1}, "algorithm.finetune_steps"),
        ({"name": "fedper", "weighting": "size"}, "algorithm.weighting"),
    ],
)
def test_invalid_hyperparameters_name_the_key(algorithm, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        run(algorithm)


@pytest.mark.parametrize(
    "name",
    [
        "fedper",
    ],
)
def test_a_model_without_body_is_refused(name):
    config = digits_config({"name": name})
    config["model"] = {"name": "logreg"}
    with pytest.raises(ConfigError, match=r"algorithm\.name"):
        fedloom.run(config, write=False, progress=False)


# -- learning on the shared personalized setup (tests/algorithms/pfl_setup.py) -------------
@pytest.mark.slow
def test_fedper_beats_fedavg_on_label_shards(data_root):
    # Measured (seed 0): personalized mean 0.9548, P10 0.8978; FedAvg's global model on the
    # same clients 0.6215.
    result = run_pfl({"name": "fedper"})
    accuracy = result.summary["final"]["personalized"]["accuracy_mean"]
    assert accuracy >= fedavg_accuracy_on_clients() + 0.30, accuracy
