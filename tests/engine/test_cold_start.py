"""The cold-start evaluation (engine/cold_start.py): held-out clients served the algorithm's
way, then fine-tuned; summary.json's ``cold_start`` against a hand-written SGD loop."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fedloom
from fedloom.config import parse_config
from fedloom.data.load import load_dataset
from fedloom.errors import ConfigError
from fedloom.models import build_model
from fedloom.solvers.local import PlanMaker

NEW = 3


def config(algorithm: dict, **eval_: object) -> dict:
    return {
        "seed": 2,
        "data": {
            "name": "digits",
            "num_clients": 9,
            "partition": {"kind": "dirichlet", "alpha": 0.5},
        },
        "model": {"name": "mlp"},
        "algorithm": algorithm,
        "train": {"rounds": 3, "clients_per_round": 3, "local_steps": 5, "batch_size": 16},
        "eval": {"every": 3, "new_clients": NEW, **eval_},
    }


def manual_curve(
    cfg: dict, start: dict, steps: list[int], lr: float, keys=None
) -> tuple[list[float], list[float]]:
    """Mean accuracy and loss over the new clients after each number of plain SGD steps from
    ``start`` (params and buffers in one dict), minibatches from the stream (seed, 'adapt',
    rounds, c)."""
    run_config = parse_config(cfg)
    data = load_dataset(run_config.data, run_config.seed)
    module = build_model(run_config.model.name, data.input_shape, data.num_outputs)
    make_plan = PlanMaker(run_config.seed, run_config.train.batch_size)
    per_step: dict[int, list[float]] = {s: [] for s in steps}
    losses: dict[int, list[float]] = {s: [] for s in steps}
    for cid in range(data.num_clients - NEW, data.num_clients):
        client = data.clients[cid]
        module.load_state_dict(start)
        plan = make_plan(client, max(steps), "adapt", run_config.train.rounds, cid)
        for done in range(max(steps) + 1):
            if done in per_step:
                with torch.no_grad():
                    out = module(client.x_test)
                per_step[done].append(float((out.argmax(-1) == client.y_test).double().mean()))
                losses[done].append(float(torch.nn.functional.cross_entropy(out, client.y_test)))
            if done == max(steps):
                break
            idx = plan[done]
            loss = torch.nn.functional.cross_entropy(
                module(client.x_train[idx]), client.y_train[idx]
            )
            params = [p for n, p in module.named_parameters() if keys is None or n in keys]
            grads = torch.autograd.grad(loss, params)
            with torch.no_grad():
                for p, g in zip(params, grads, strict=True):
                    p.sub_(lr * g)
    return [float(np.mean(per_step[s])) for s in steps], [float(np.mean(losses[s])) for s in steps]


def test_fedavg_new_clients_fine_tune_the_global_model():
    cfg = config({"name": "fedavg"})
    result = fedloom.run(cfg, write=False, progress=False)
    curve = result.summary["cold_start"]
    assert curve["steps"] == [0, 1, 5, 20] and curve["clients"] == NEW
    assert curve["lr"] == 0.05  # train.lr by default
    accuracy, loss = manual_curve(cfg, result.global_params, curve["steps"], 0.05)
    assert np.allclose(curve["accuracy_mean"], accuracy, atol=1e-9), (curve, accuracy)
    assert np.allclose(curve["loss_mean"], loss, atol=1e-5), (curve, loss)
    # step 0 is the model the new clients are served, as every evaluated round reports
    final_new = result.summary["final"]["new_clients"]["accuracy_mean"]
    assert math.isclose(curve["accuracy_mean"][0], final_new, abs_tol=1e-9)
    assert curve["loss_mean"][-1] < curve["loss_mean"][0]


def test_fedper_new_clients_fine_tune_only_the_head():
    cfg = config({"name": "fedper"}, adaptation_steps=[5, 0], adapt_lr=0.2)
    result = fedloom.run(cfg, write=False, progress=False)
    curve = result.summary["cold_start"]
    assert curve["steps"] == [0, 5] and curve["lr"] == 0.2
    # a never-trained client deploys the shared body with the initial head
    start = result.client_params[cfg["data"]["num_clients"] - 1]
    head = ["fc3.weight", "fc3.bias"]
    accuracy, loss = manual_curve(cfg, start, [0, 5], 0.2, keys=head)
    assert np.allclose(curve["accuracy_mean"], accuracy, atol=1e-9), (curve, accuracy)
    assert np.allclose(curve["loss_mean"], loss, atol=1e-5), (curve, loss)
    _, loss_all = manual_curve(cfg, start, [0, 5], 0.2)
    assert abs(loss_all[1] - loss[1]) > 1e-3, "training the body too would differ"


def test_no_new_clients_no_cold_start():
    cfg = config({"name": "fedavg"})
    cfg["eval"]["new_clients"] = 0
    assert "cold_start" not in fedloom.run(cfg, write=False, progress=False).summary


@pytest.mark.parametrize("steps", [[], [-1, 5]])
def test_invalid_adaptation_steps_are_refused(steps):
    with pytest.raises(ConfigError, match="adaptation_steps"):
        parse_config(config({"name": "fedavg"}, adaptation_steps=steps))
