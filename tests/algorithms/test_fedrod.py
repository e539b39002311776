"""FedRoD (Chen & Chao, ICLR 2022, arXiv:2107.00778): the balanced softmax against a hand
computation (and the public code's log 0 = -inf), a client's steps of Eq. (4)-(6) against
hand-written SGD, the deployed model's logits h_psi(z) + h_phi(z), the reduction to FedAvg with
``balanced_loss: ce``, the refusals, and learning on the shared Fashion-MNIST shards setup."""

from __future__ import annotations

import math
import re

import pytest
import torch
import torch.nn.functional as F

import fedloom
from fedloom.algorithms import ClientTask, build_algorithm
from fedloom.algorithms.client import client_program
from fedloom.algorithms.fedrod import balanced_softmax_loss, log_class_counts
from fedloom.errors import ConfigError
from fedloom.solvers.sequential import run_client
from tests.algorithms.digits_setup import digits_config
from tests.algorithms.pfl_setup import run_pfl
from tests.algorithms.tiny_2nn_setup import CLASSES, client_data, features, make_ctx, run
from tests.engine.test_determinism import CONFIG as RESUME_CONFIG
from tests.resume import killed_and_resumed

HEAD = ["fc3.weight", "fc3.bias"]


def test_balanced_softmax_equals_a_hand_computation():
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 1.0]])
    y = torch.tensor([0, 1])
    log_counts = log_class_counts(torch.tensor([0, 0, 0, 1]), 3)  # n = (3, 1, 0)
    assert log_counts[2] == -1e4
    # -log(n_y e^{z_y} / sum_c n_c e^{z_c}): class 2 has no sample, so no weight
    hand = [
        -math.log(3 * math.exp(1.0) / (3 * math.exp(1.0) + math.exp(2.0))),
        -math.log(math.exp(-1.0) / (3 * math.exp(0.0) + math.exp(-1.0))),
    ]
    assert float(balanced_softmax_loss(logits, y, log_counts)) == pytest.approx(sum(hand) / 2)
    # the public code's log 0 = -inf gives the same value
    public = F.cross_entropy(logits + torch.tensor([3.0, 1.0, 0.0]).log(), y)
    assert float(balanced_softmax_loss(logits, y, log_counts)) == pytest.approx(float(public))
    # a padding sample (weight 0) of an absent class stays finite and counts for nothing
    w = torch.tensor([1.0, 0.0])
    padded = balanced_softmax_loss(logits, torch.tensor([0, 2]), log_counts, w)
    assert float(padded) == pytest.approx(hand[0], rel=1e-6)


def test_fedrod_client_steps_train_the_generic_model_by_bsm_and_the_personal_head_by_ce():
    data = client_data([0, 1, 1, 2, 3, 3, 5], seed=6)
    ctx = make_ctx({0: data.num_train})
    lr = 0.5
    algo = build_algorithm({"name": "fedrod"}, ctx)
    server = algo.init_server_state(*ctx.model.initial_state(0))
    state = algo.init_client_state(server, 0)
    for k in HEAD:  # the P-head starts as the G-head
        assert torch.equal(state["params"][k], server["params"][k]), k
    gen = torch.Generator().manual_seed(2)
    personal = {
        k: v + 0.2 * torch.randn(v.shape, generator=gen) for k, v in state["params"].items()
    }
    full = torch.arange(data.num_train)
    task = ClientTask(0, data, [full, full], lr, 1)
    result = run_client(
        client_program(algo), algo.server_message(server), {"params": personal}, task
    )

    x, y = data.x_train, data.y_train
    counts = torch.bincount(y, minlength=CLASSES).float()  # absent classes: log 0 = -inf
    params, phi = dict(server["params"]), dict(personal)
    for _ in range(2):
        leaves = {k: v.clone().requires_grad_(True) for k, v in params.items()}
        z = features(leaves, x)
        g = F.linear(z, leaves["fc3.weight"], leaves["fc3.bias"])
        bsm = F.cross_entropy(g + counts.log(), y)
        grads = torch.autograd.grad(bsm, list(leaves.values()))
        heads = {k: v.clone().requires_grad_(True) for k, v in phi.items()}
        p = F.linear(z.detach(), heads["fc3.weight"], heads["fc3.bias"])
        ce = F.cross_entropy(g.detach() + p, y)
        head_grads = torch.autograd.grad(ce, list(heads.values()))
        params = {k: v.detach() - lr * d for (k, v), d in zip(leaves.items(), grads, strict=True)}
        phi = {k: v.detach() - lr * d for (k, v), d in zip(heads.items(), head_grads, strict=True)}
    for k, value in params.items():
        assert torch.allclose(result.upload["params"][k], value, atol=1e-6), k
    for k, value in phi.items():
        assert torch.allclose(result.state["params"][k], value, atol=1e-6), k
    assert sorted(result.state["params"]) == sorted(HEAD)  # only the P-head stays on the client

    # deployed: the logits h_psi(z) + h_phi(z)
    new = algo.aggregate(server, [result])
    deployed, _ = algo.deployed_model(new, result.state, task)
    z = features(new["params"], x)
    expected = F.linear(z, new["params"]["fc3.weight"], new["params"]["fc3.bias"]) + F.linear(
        z, phi["fc3.weight"], phi["fc3.bias"]
    )
    assert torch.allclose(ctx.model.forward(deployed, {}, x), expected, atol=1e-5)


def flat_gap(a: dict, b: dict) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@pytest.mark.parametrize("stragglers", [0.0, 0.4])
def test_fedrod_with_plain_ce_has_fedavgs_global_model(stragglers):
    fedavg = run({"name": "fedavg"}, stragglers=stragglers)
    ce = run({"name": "fedrod", "balanced_loss": "ce"}, stragglers=stragglers)
    # measured 0.0: the same SGD, through FedRoD's step instead of the fused trainer
    assert flat_gap(ce.global_params, fedavg.global_params) < 1e-6
    assert fedavg.summary["communication"] == ce.summary["communication"]
    # the personal heads change only the deployed models
    assert flat_gap(ce.client_params[0], fedavg.client_params[0]) > 1e-3
    bsm = run({"name": "fedrod"}, stragglers=stragglers)
    assert flat_gap(bsm.global_params, fedavg.global_params) > 1e-3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"privacy": {"kind": "sample_dp", "noise_multiplier": 1.0, "clip": 1.0}}, "fedrod"),
        ({"train": {"rounds": 1, "optimizer": {"kind": "adamw"}}}, "fedrod"),
        ({"algorithm": {"name": "fedrod", "balanced_loss": "focal"}}, "algorithm.balanced_loss"),
    ],
)
def test_fedrod_refuses_what_cannot_apply(extra, message):
    cfg = digits_config({"name": "fedrod"})
    for section, values in extra.items():
        cfg[section] = {**cfg.get(section, {}), **values} if section == "train" else values
    with pytest.raises(ConfigError, match=re.escape(message)):
        fedloom.run(cfg, write=False, progress=False)


# -- learning on the shared personalized setup (tests/algorithms/pfl_setup.py) -------------
@pytest.mark.slow
@pytest.mark.heavy(budget=90)  # measured 24 s on a loaded 2-core machine
def test_fedrod_personal_heads_beat_the_generic_model_on_label_shards(data_root):
    # 5 rounds. Measured (seed 0): personalized mean 0.929, the generic model 0.309 (FedAvg's
    # global model 0.438). After 10 rounds: 0.940 / 0.309, FedAvg 0.404; with balanced_loss: ce
    # 0.917 / 0.404 (the generic model is FedAvg's).
    result = run_pfl({"name": "fedrod"}, rounds=5)
    final = result.summary["final"]
    accuracy = final["personalized"]["accuracy_mean"]
    assert accuracy >= 0.88, accuracy
    assert accuracy >= final["global"]["accuracy"] + 0.5, final


def test_fedrod_killed_and_resumed_run_equals_uninterrupted(tmp_path):
    # the client state (the personal head) is checkpointed: partial participation, stragglers
    config = {**RESUME_CONFIG, "algorithm": {"name": "fedrod"}}
    _, _, saved = killed_and_resumed(config, tmp_path, crash_round=5)
    assert saved["round"] == 4
