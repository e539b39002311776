"""FedBABU (Oh, Kim, Yun, ICLR 2022, arXiv:2106.06042): local steps on the body only against
hand-written SGD, the head fixed at its initialization through training, the body-only
aggregation and communication, the fine-tuned deployment (FedAvg-FT's, on the part
``finetune_part`` names), the reductions to FedAvg and FedAvg-FT with the head unfrozen, the
refusals, and learning on the shared Fashion-MNIST shards setup."""

from __future__ import annotations

import re

import pytest
import torch

import fedloom
from fedloom.algorithms import ClientTask, build_algorithm
from fedloom.algorithms.client import client_program
from fedloom.config import parse_config
from fedloom.core.protocol import ClientData
from fedloom.core.pytree import num_bytes
from fedloom.data.load import load_dataset
from fedloom.errors import ConfigError
from fedloom.solvers.ops import PrivacyRefused
from fedloom.solvers.sequential import run_client
from tests.algorithms.digits_setup import (
    BODY,
    HEAD,
    TRAINED,
    assert_same_global,
    digits_config,
    initial_params,
)
from tests.algorithms.digits_setup import digits_ctx as make_ctx
from tests.algorithms.digits_setup import run_digits as run
from tests.algorithms.pfl_setup import run_pfl


def digits_client(client: int) -> ClientData:
    cfg = parse_config(digits_config({"name": "fedbabu"}))
    return load_dataset(cfg.data, cfg.seed).clients[client]


def test_fedbabu_trains_the_body_with_the_head_frozen_and_uploads_the_body():
    data = digits_client(0)
    ctx = make_ctx()
    algo = build_algorithm({"name": "fedbabu"}, ctx)
    server = algo.init_server_state(*ctx.model.initial_state(0))
    plan = ctx.make_plan(data, 4, "batches", 0, 0)
    lr = 0.1
    result = run_client(
        client_program(algo), algo.server_message(server), None, ClientTask(0, data, plan, lr, 0)
    )

    params = dict(server["params"])  # hand-written SGD, the head a constant
    for idx in plan:
        leaves = {k: params[k].detach().requires_grad_(True) for k in BODY}
        with torch.enable_grad():
            loss = ctx.model.loss({**params, **leaves}, {}, data.x_train[idx], data.y_train[idx])
            grads = torch.autograd.grad(loss, list(leaves.values()))
        params.update({k: leaves[k].detach() - lr * g for k, g in zip(BODY, grads, strict=True)})
    assert sorted(result.upload["params"]) == sorted(BODY)  # the head is never uploaded
    for k in BODY:
        assert torch.allclose(result.upload["params"][k], params[k], atol=1e-6), k
        assert not torch.equal(params[k], server["params"][k]), k
    assert result.weight == data.num_train

    # the server averages the bodies (weights n_k) and keeps the initial head
    data1 = digits_client(1)
    other = ClientTask(1, data1, ctx.make_plan(data1, 2, "batches", 0, 1), lr, 0)
    second = run_client(client_program(algo), algo.server_message(server), None, other)
    new = algo.aggregate(server, [result, second])
    assert list(new["params"]) == list(server["params"])  # the model's own key order
    n0, n1 = result.weight, second.weight
    for k in BODY:
        expected = (n0 * result.upload["params"][k] + n1 * second.upload["params"][k]) / (n0 + n1)
        assert torch.allclose(new["params"][k], expected, atol=1e-6), k
    for k in HEAD:
        assert torch.equal(new["params"][k], server["params"][k]), k


def test_fedbabu_head_stays_at_its_initialization_and_only_the_body_is_communicated():
    babu = run({"name": "fedbabu", "finetune_steps": 0})
    fedavg = run({"name": "fedavg"})
    initial = initial_params()
    for k in HEAD:
        assert torch.equal(babu.global_params[k], initial[k]), k
    body_gap = max(
        float((babu.global_params[k] - fedavg.global_params[k]).abs().max()) for k in BODY
    )
    assert body_gap > 1e-3, body_gap
    # bytes: the body each way (no buffers in the 2NN), 3 clients x 3 rounds
    body_bytes = num_bytes({k: initial[k] for k in BODY})
    communication = babu.summary["communication"]
    assert communication["bytes_down"] == 9 * body_bytes
    assert communication["bytes_up"] == 9 * body_bytes
    assert fedavg.summary["communication"]["bytes_down"] == 9 * num_bytes(initial)


def test_fedbabu_with_the_head_unfrozen_and_no_finetuning_is_fedavg():
    fedavg = run({"name": "fedavg"})
    babu = run({"name": "fedbabu", "freeze_head": False, "finetune_steps": 0})
    # measured: bit-identical
    assert_same_global(fedavg, babu)
    assert [h["train_loss"] for h in fedavg.history] == [h["train_loss"] for h in babu.history]
    assert fedavg.summary["communication"] == babu.summary["communication"]


def test_fedbabu_with_the_head_unfrozen_is_fedavg_ft():
    # FedAvg-FT's fine-tuning, reused: the deployed models are the same, bit for bit
    ft = run({"name": "fedavg_ft", "finetune_steps": 6})
    babu = run({"name": "fedbabu", "freeze_head": False, "finetune_steps": 6})
    for c in TRAINED:
        for k, value in ft.client_params[c].items():
            assert torch.equal(babu.client_params[c][k], value), (c, k)


@pytest.mark.parametrize(("part", "moved", "fixed"), [("head", HEAD, BODY), ("body", BODY, HEAD)])
def test_fedbabu_finetunes_the_part_it_names(part, moved, fixed):
    result = run({"name": "fedbabu", "finetune_steps": 5, "finetune_part": part})
    for c in TRAINED:
        deployed = result.client_params[c]
        for k in fixed:
            assert torch.equal(deployed[k], result.global_params[k]), (c, k)
        gap = max(float((deployed[k] - result.global_params[k]).abs().max()) for k in moved)
        assert gap > 1e-4, (c, gap)
    # every client at once on the stacked model (the vectorized executor's deployment)
    cfg = digits_config({"name": "fedbabu", "finetune_steps": 5, "finetune_part": part})
    cfg["executor"] = {"kind": "vectorized"}
    stacked = fedloom.run(cfg, write=False, progress=False)
    for c in TRAINED:
        for k, value in result.client_params[c].items():
            assert torch.allclose(stacked.client_params[c][k], value, atol=1e-4), (c, k)
    full = run({"name": "fedbabu", "finetune_steps": 5})
    for k in BODY + HEAD:  # the paper's full fine-tuning moves both
        assert not torch.equal(full.client_params[0][k], full.global_params[k]), k


def test_fedbabu_adamw_steps_move_the_body_only_on_both_backends():
    runs = []
    for executor in ({"kind": "sequential"}, {"kind": "vectorized", "chunk_size": 2}):
        cfg = digits_config({"name": "fedbabu", "finetune_steps": 0}, lr=0.003, rounds=2)
        cfg["train"]["optimizer"] = {"kind": "adamw"}  # decoupled weight decay, too
        cfg["executor"] = executor
        runs.append(fedloom.run(cfg, write=False, progress=False))
    initial = initial_params()
    for run_ in runs:
        for k in HEAD:
            assert torch.equal(run_.global_params[k], initial[k]), k
    for k in BODY:  # measured 1e-6 apart
        assert torch.allclose(runs[0].global_params[k], runs[1].global_params[k], atol=1e-4), k
        assert not torch.equal(runs[0].global_params[k], initial[k]), k


@pytest.mark.parametrize(
    ("extra", "error"),
    [
        ({"privacy": {"kind": "client_dp", "noise_multiplier": 1.0, "clip": 1.0}}, ConfigError),
        ({"privacy": {"kind": "sample_dp", "noise_multiplier": 1.0, "clip": 1.0}}, PrivacyRefused),
    ],
)
def test_fedbabu_refuses_what_cannot_apply(extra, error):
    # client-level DP needs whole uploaded models; sample-level DP non-private fine-tuning
    with pytest.raises(error, match="fedbabu"):
        fedloom.run({**digits_config({"name": "fedbabu"}), **extra}, write=False, progress=False)


def test_fedbabu_sample_dp_without_finetuning_runs_privately():
    cfg = digits_config({"name": "fedbabu", "finetune_steps": 0}, rounds=1)
    cfg["privacy"] = {"kind": "sample_dp", "noise_multiplier": 1.0, "clip": 1.0}
    result = fedloom.run(cfg, write=False, progress=False)
    assert result.summary["privacy"]["epsilon"] > 0
    initial = initial_params()
    for k in HEAD:  # the head's noised gradient is dropped
        assert torch.equal(result.global_params[k], initial[k]), k


@pytest.mark.parametrize(
    ("algorithm", "model", "key"),
    [
        ({"name": "fedbabu", "finetune_part": "neck"}, "mlp", "algorithm.finetune_part"),
        ({"name": "fedbabu", "freeze_head": "yes"}, "mlp", "algorithm.freeze_head"),
        ({"name": "fedbabu"}, "logreg", "algorithm.name"),  # a head and no body
    ],
)
def test_invalid_configs_name_the_key(algorithm, model, key):
    cfg = digits_config(algorithm)
    cfg["model"] = {"name": model}
    with pytest.raises(ConfigError, match=re.escape(key)):
        fedloom.run(cfg, write=False, progress=False)


# -- learning on the shared personalized setup (tests/algorithms/pfl_setup.py) -------------
@pytest.mark.slow
@pytest.mark.heavy(budget=90)  # measured 16 s on a loaded 2-core machine
def test_fedbabu_finetuned_models_fit_their_clients_on_label_shards(data_root):
    # 10 rounds, 10 full fine-tuning steps. Measured (seed 0): personalized mean 0.871 (FedAvg-FT
    # on the same setup: 0.872; 0.895 with 20 fine-tuning steps), the global model (body with
    # the random head, not fine-tuned) 0.362.
    result = run_pfl({"name": "fedbabu"}, rounds=10)
    final = result.summary["final"]
    accuracy = final["personalized"]["accuracy_mean"]
    assert accuracy >= 0.85, accuracy
    assert accuracy >= final["global"]["accuracy"] + 0.4, final
