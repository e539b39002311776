"""MOON (Li, He, Song, CVPR 2021, arXiv:2103.16257): the contrastive loss of Eq. (3) against
a hand computation, the local steps of Eq. (4) against hand-written SGD (the global and the
previous model frozen), the previous model kept as client state, the reduction mu = 0 (FedAvg),
configuration errors, and learning on Fashion-MNIST label skew."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import fedloom
from fedloom.algorithms import ClientTask, build_algorithm
from fedloom.algorithms.client import client_program
from fedloom.algorithms.moon import contrastive_loss
from fedloom.errors import ConfigError
from fedloom.solvers.sequential import run_client
from tests.algorithms.tiny_2nn_setup import client_data, features, logits, make_ctx, run
from tests.engine.test_determinism import CONFIG as RESUME_CONFIG
from tests.resume import killed_and_resumed


def test_contrastive_loss_equals_a_hand_computation():
    z = torch.tensor([[1.0, 0.0], [1.0, 1.0]])
    z_glob = torch.tensor([[1.0, 1.0], [2.0, 2.0]])
    z_prev = torch.tensor([[0.0, 3.0], [-1.0, 0.0]])
    tau = 0.5
    # sample 1: cos(z, z_glob) = 1/sqrt(2), cos(z, z_prev) = 0
    # sample 2: cos(z, z_glob) = 1,         cos(z, z_prev) = -1/sqrt(2)
    sims = [(1 / math.sqrt(2), 0.0), (1.0, -1 / math.sqrt(2))]
    per = [-math.log(math.exp(g / tau) / (math.exp(g / tau) + math.exp(p / tau))) for g, p in sims]
    assert float(contrastive_loss(z, z_glob, z_prev, tau)) == pytest.approx(sum(per) / 2, 1e-6)
    # padded batch: a weight-0 sample counts for nothing
    w = torch.tensor([1.0, 0.0])
    assert float(contrastive_loss(z, z_glob, z_prev, tau, w)) == pytest.approx(per[0], 1e-6)
    # a previous model equal to the global one: log 2 whatever z is
    assert float(contrastive_loss(z, z_glob, z_glob, tau)) == pytest.approx(math.log(2), 1e-6)


def cosine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(-1) / (a.norm(dim=-1) * b.norm(dim=-1))


def test_moon_local_steps_contrast_the_global_and_the_previous_model():
    data = client_data([0, 1, 1, 2, 3, 3, 5], seed=6)
    ctx = make_ctx({0: data.num_train})
    mu, tau, lr = 2.0, 0.7, 0.5
    algo = build_algorithm({"name": "moon", "mu": mu, "tau": tau}, ctx)
    server = algo.init_server_state(*ctx.model.initial_state(0))
    state = algo.init_client_state(server, 0)
    assert all(torch.equal(state["params"][k], v) for k, v in server["params"].items())
    gen = torch.Generator().manual_seed(1)
    previous = {  # the client's model of an earlier round
        k: v + 0.3 * torch.randn(v.shape, generator=gen) for k, v in server["params"].items()
    }
    state = {**state, "params": previous}
    full = torch.arange(data.num_train)
    task = ClientTask(0, data, [full, full], lr, 1)
    result = run_client(client_program(algo), algo.server_message(server), state, task)

    x, y = data.x_train, data.y_train
    z_glob, z_prev = features(server["params"], x), features(previous, x)
    params = dict(server["params"])
    for _ in range(2):
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        z = features(leaves, x)
        s_glob, s_prev = cosine(z, z_glob) / tau, cosine(z, z_prev) / tau
        con = -torch.log(torch.exp(s_glob) / (torch.exp(s_glob) + torch.exp(s_prev))).mean()
        loss = F.cross_entropy(logits(leaves, x), y) + mu * con
        grads = torch.autograd.grad(loss, list(leaves.values()))
        params = {k: p.detach() - lr * g for (k, p), g in zip(leaves.items(), grads, strict=True)}
    plain = dict(server["params"])
    for _ in range(2):  # plain CE steps, for contrast
        leaves = {k: v.clone().requires_grad_(True) for k, v in plain.items()}
        grads = torch.autograd.grad(F.cross_entropy(logits(leaves, x), y), list(leaves.values()))
        plain = {k: p.detach() - lr * g for (k, p), g in zip(leaves.items(), grads, strict=True)}
    for k, value in params.items():
        assert torch.allclose(result.upload["params"][k], value, atol=1e-6), k
        # the trained model is the next round's previous model
        assert torch.equal(result.state["params"][k], result.upload["params"][k]), k
    assert max(float((params[k] - plain[k]).abs().max()) for k in params) > 1e-4


def test_moon_first_round_has_no_negative():
    # the state starts as the global model: z_prev = z_glob, l_con = log 2 with zero gradient
    data = client_data([0, 1, 1, 2, 3, 3, 5], seed=6)
    ctx = make_ctx({0: data.num_train})
    full = torch.arange(data.num_train)
    task = ClientTask(0, data, [full, full, full], 0.5, 0)
    uploads = []
    for name in ("fedavg", "moon"):
        algo = build_algorithm({"name": name, **({"mu": 5.0} if name == "moon" else {})}, ctx)
        server = algo.init_server_state(*ctx.model.initial_state(0))
        state = algo.init_client_state(server, 0)
        uploads.append(
            run_client(client_program(algo), algo.server_message(server), state, task).upload
        )
    for k, value in uploads[0]["params"].items():
        assert torch.allclose(uploads[1]["params"][k], value, atol=1e-6), k


@pytest.mark.parametrize("stragglers", [0.0, 0.4])
def test_moon_with_mu_zero_is_fedavg(stragglers):
    fedavg = run({"name": "fedavg"}, stragglers=stragglers)
    moon = run({"name": "moon", "mu": 0.0}, stragglers=stragglers)
    # measured: bit-identical
    for key, value in fedavg.global_params.items():
        assert torch.equal(moon.global_params[key], value), key
    assert [h["train_loss"] for h in fedavg.history] == [h["train_loss"] for h in moon.history]
    assert fedavg.summary["communication"] == moon.summary["communication"]
    contrasted = run({"name": "moon", "mu": 5.0}, stragglers=stragglers)
    difference = max(
        float((contrasted.global_params[k] - v).abs().max())
        for k, v in fedavg.global_params.items()
    )
    assert difference > 1e-3, difference


@pytest.mark.parametrize(
    ("algorithm", "key"),
    [
        ({"name": "moon", "tau": 0.0}, "algorithm.tau"),
        ({"name": "moon", "mu": -1.0}, "algorithm.mu"),
        ({"name": "moon", "weighting": "size"}, "algorithm.weighting"),
    ],
)
def test_invalid_hyperparameters_name_the_key(algorithm, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        run(algorithm)


def test_moon_refuses_a_model_without_a_body():
    # logistic regression: the head's input is the image itself, l_con would be a constant
    config = {
        "data": {"name": "digits", "num_clients": 4},
        "model": {"name": "logreg"},
        "algorithm": {"name": "moon"},
        "train": {"rounds": 1, "local_steps": 1},
    }
    with pytest.raises(ConfigError, match=r"algorithm\.name: moon .* no body"):
        fedloom.run(config, write=False, progress=False)


def test_moon_refuses_sample_dp():
    config = {
        "data": {"name": "digits", "num_clients": 4},
        "model": {"name": "mlp"},
        "algorithm": {"name": "moon"},
        "train": {"rounds": 1, "local_steps": 1},
        "privacy": {"kind": "sample_dp", "noise_multiplier": 1.0, "clip": 1.0},
    }
    with pytest.raises(ConfigError, match="moon"):
        fedloom.run(config, write=False, progress=False)


def test_moon_killed_and_resumed_run_equals_uninterrupted(tmp_path):
    # the client state (the previous local model) is checkpointed: partial participation, stragglers
    config = {**RESUME_CONFIG, "algorithm": {"name": "moon"}}
    _, _, saved = killed_and_resumed(config, tmp_path, crash_round=5)
    assert saved["round"] == 4


@pytest.mark.slow
@pytest.mark.heavy(budget=60)  # measured 11 s on a loaded 2-core machine
def test_moon_learns_on_mnist_label_skew(data_root):
    # MNIST over 10 clients by Dirichlet(0.5), the 2NN, all clients each round, 20 local steps
    # of batch 32 at lr 0.05, 3 rounds. Measured global accuracy by round (seed 0):
    #   MOON mu 1  0.339 0.325 0.402;  mu 5  0.339 0.370 0.394;  FedAvg  0.339 0.337 0.421
    # (round 1 equals FedAvg's: no negative yet). With the 2NN MOON does not beat FedAvg here,
    # nor with 50 steps on Dirichlet(0.1) (0.433 / 0.479 against 0.444 / 0.483, seeds 0 / 1);
    # the paper's gains are on CIFAR CNNs with a projection head.
    config = {
        "seed": 0,
        "data": {
            "name": "mnist",
            "num_clients": 10,
            "partition": {"kind": "dirichlet", "alpha": 0.5},
        },
        "model": {"name": "mlp"},
        "algorithm": {"name": "moon", "mu": 1.0},
        "train": {
            "rounds": 3,
            "clients_per_round": 10,
            "local_steps": 20,
            "batch_size": 32,
            "lr": 0.05,
        },
        "eval": {"every": 1},
        "executor": {"kind": "auto"},
    }
    result = fedloom.run(config, write=False, progress=False)
    curve = [row["global"]["accuracy"] for row in result.history]
    assert curve[-1] >= 0.36, curve
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"], result.history
