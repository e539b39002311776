"""Reptile (Nichol, Achiam, Schulman, 2018, arXiv:1803.02999) as a federated algorithm: its
reduction to FedAvg at epsilon 1, the server step theta + epsilon (mean phi - theta) scaled
exactly by epsilon, the deployed (adapted) model, and learning on the shared Fashion-MNIST
shards setup.

Reptile keeps no client state (None), so there is no kill-and-resume test: a resumed run only
needs the server state, which every algorithm's checkpoint carries.
"""

from __future__ import annotations

import re

import pytest
import torch

from fedloom.algorithms import build_algorithm
from fedloom.core.functional import FunctionalModel
from fedloom.errors import ConfigError
from fedloom.models import MLP
from tests.algorithms.meta_setup import (
    check_deployed_is_adapted,
    run,
    tiny_ctx,
    uniform_uploads,
)
from tests.algorithms.pfl_setup import fedavg_accuracy_on_clients, run_pfl


@pytest.mark.parametrize("local_steps", [1, 5])
def test_reptile_with_epsilon_one_is_fedavg(local_steps):
    fedavg = run({"name": "fedavg"}, local_steps=local_steps)
    reptile = run(
        {"name": "reptile", "epsilon": 1.0, "weighting": "samples", "adapt_steps": 0},
        local_steps=local_steps,
    )
    for key, value in fedavg.global_params.items():
        # measured: 7.5e-9 (the float64 server step rounds back to float32)
        assert torch.allclose(value, reptile.global_params[key], rtol=0, atol=1e-6), key
    for c, params in reptile.client_params.items():  # adapt_steps 0: every client deploys theta
        for key, value in params.items():
            assert torch.equal(value, reptile.global_params[key]), (c, key)
    assert fedavg.summary["communication"] == reptile.summary["communication"]


def test_reptile_epsilon_scales_the_server_step_exactly():
    theta0, _ = FunctionalModel(MLP((1, 8, 8), 10), "classification").initial_state(3)
    full = run({"name": "reptile", "epsilon": 1.0}, rounds=1)
    half = run({"name": "reptile", "epsilon": 0.5}, rounds=1)
    for key, start in theta0.items():
        step_full = full.global_params[key] - start
        step_half = half.global_params[key] - start
        assert torch.allclose(step_half, 0.5 * step_full, rtol=0, atol=1e-7), key
        assert step_full.abs().max() > 1e-3


def test_reptile_server_step_with_uniform_weights():
    ctx, _ = tiny_ctx()
    algo = build_algorithm({"name": "reptile", "epsilon": 0.3}, ctx)
    server = algo.init_server_state(*ctx.model.initial_state(0))
    assert sorted(server) == ["buffers", "params"]  # no optimizer slots
    phis, results = uniform_uploads(ctx, server["params"], 2, seed=1)
    new = algo.aggregate(server, results)
    for k, theta in server["params"].items():
        expected = theta + 0.3 * ((phis[0][k] + phis[1][k]) / 2 - theta)
        assert torch.allclose(new["params"][k], expected, rtol=0, atol=1e-12), k


def test_deployed_model_is_theta_after_adapt_steps_sgd_steps_at_the_round_lr():
    check_deployed_is_adapted("reptile", 0.2)


# -- configuration --------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("algorithm", "key"),
    [
        ({"name": "reptile", "epsilon": 0}, "algorithm.epsilon"),
        ({"name": "reptile", "weighting": "size"}, "algorithm.weighting"),
    ],
)
def test_invalid_hyperparameters_name_the_key(algorithm, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        run(algorithm)


# -- learning on the shared personalized setup (tests/algorithms/pfl_setup.py) -------------
@pytest.mark.slow
def test_reptile_beats_fedavg_on_label_shards(data_root):
    # Measured (seed 0, epsilon 1, one adaptation step at train.lr): personalized mean 0.9405
    # (P10 0.857); epsilon 0.5: 0.9183. FedAvg's global model on the same clients: 0.6215.
    # Every client holds 2 shards of equal size, so uniform weights are FedAvg's n_k/n and
    # epsilon 1 trains FedAvg's global model exactly (0.6214 here): the gain is the one
    # adaptation step (FedAvg + one step at 0.05 on another minibatch, fedavg_ft: 0.9459).
    result = run_pfl({"name": "reptile"})
    accuracy = result.summary["final"]["personalized"]["accuracy_mean"]
    assert accuracy >= fedavg_accuracy_on_clients() + 0.25, accuracy
