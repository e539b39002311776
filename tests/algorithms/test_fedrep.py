"""FedRep (Collins et al., ICML 2021, arXiv:2102.07078): its two phases (the head with the body
frozen, then the body with the head frozen) against hand-written SGD, the head phase's length,
configuration errors, and learning on the shared Fashion-MNIST shards setup. What it shares with
FedPer and LG-FedAvg is tested in tests/algorithms/test_partial.py."""

from __future__ import annotations

import math
import re

import pytest
import torch

import fedloom
from fedloom.algorithms import ClientTask, build_algorithm
from fedloom.algorithms.client import client_program
from fedloom.config import parse_config
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.core.pytree import Tree
from fedloom.data.load import load_dataset
from fedloom.errors import ConfigError
from fedloom.models.base import FedModel
from fedloom.solvers.local import PlanMaker
from fedloom.solvers.ops import AUTOGRAD
from fedloom.solvers.program import Batch
from fedloom.solvers.sequential import run_client
from tests.algorithms.digits_setup import (
    BODY,
    HEAD,
    TRAINED,
    digits_config,
    flat,
    initial_params,
)
from tests.algorithms.digits_setup import digits_ctx as make_ctx
from tests.algorithms.digits_setup import run_digits as run
from tests.algorithms.pfl_setup import fedavg_accuracy_on_clients, run_pfl


def digits_client(client: int) -> ClientData:
    cfg = parse_config(digits_config({"name": "fedrep"}))
    return load_dataset(cfg.data, cfg.seed).clients[client]


# -- FedRep's two phases ---------------------------------------------------------------------
def hand_sgd(
    model: FunctionalModel,
    params: Tree,
    data: ClientData,
    plan: list[torch.Tensor],
    lr: float,
    keys: list[str],
) -> Tree:
    """Plain SGD with autograd on ``keys`` only: the other parameters are constants."""
    params = dict(params)
    for idx in plan:
        leaves = {k: params[k].detach().requires_grad_(True) for k in keys}
        with torch.enable_grad():
            loss = model.loss({**params, **leaves}, {}, data.x_train[idx], data.y_train[idx])
            grads = torch.autograd.grad(loss, list(leaves.values()))
        for k, g in zip(keys, grads, strict=True):
            params[k] = leaves[k].detach() - lr * g
    return params


def test_fedrep_trains_the_head_with_the_body_frozen_then_the_body_with_the_head_frozen():
    data = digits_client(0)
    ctx = make_ctx()
    ctx.batch_size, ctx.make_plan = 16, PlanMaker(0, 16)
    algo = build_algorithm({"name": "fedrep", "head_steps": 7, "weighting": "samples"}, ctx)
    server = algo.init_server_state(*ctx.model.initial_state(0))
    state = algo.init_client_state(server, 0)
    gen = torch.Generator().manual_seed(0)
    state["params"] = {  # a head of its own, as after earlier rounds
        k: v + 0.1 * torch.randn(v.shape, generator=gen) for k, v in state["params"].items()
    }
    full = ctx.make_plan(data, 12, "batches", 2, 0)
    task = ClientTask(0, data, full[:5], 0.05, 2, full=12)  # a straggler: 5 of its 12 steps
    message = algo.server_message(server)
    program = client_program(algo)

    # head phase: 7 steps from the stream (seed, 'head', 2, 0) from step 0, then the body on
    # the straggler's 5 steps of the engine's plan, starting where the head phase ends
    plans = program.plans(message, state, task)
    head_plan, body_plan = plans["fedrep/head"], plans["batches"]
    expected_plan = ctx.make_plan(data, 7, "head", 2, 0)
    assert head_plan.start == 0 and len(head_plan.batches) == 7
    assert all(torch.equal(a, b) for a, b in zip(head_plan.batches, expected_plan, strict=True))
    assert body_plan.batches is task.plan and body_plan.start == 7

    # each phase leaves the other part bit for bit: one step of each from [server body, head]
    carry, shared = program.init(message, state, task), program.shared(message, task)
    start = dict(carry["params"])
    assert all(torch.equal(start[k], server["params"][k]) for k in BODY)
    assert all(torch.equal(start[k], state["params"][k]) for k in HEAD)
    idx = task.plan[0]
    batch = Batch(data.x_train[idx], data.y_train[idx], torch.ones(idx.shape[0]))
    after_head, _ = program.head_step(AUTOGRAD, carry, (batch,), shared)
    after_body, _ = program.body_step(AUTOGRAD, carry, (batch,), shared)
    assert all(torch.equal(after_head["params"][k], start[k]) for k in BODY)
    assert all(torch.equal(after_body["params"][k], start[k]) for k in HEAD)

    # the whole round against plain SGD by hand on each part (measured: 1.5e-8, float32,
    # two summation orders)
    result = run_client(client_program(algo), message, state, task)
    middle = hand_sgd(ctx.model, start, data, expected_plan, 0.05, HEAD)
    end = hand_sgd(ctx.model, middle, data, task.plan, 0.05, BODY)
    assert (middle["fc3.weight"] - start["fc3.weight"]).abs().max() > 1e-3
    assert (end["fc1.weight"] - middle["fc1.weight"]).abs().max() > 1e-4

    # upload the body, keep the head; the steps of both phases count
    assert sorted(result.upload["params"]) == sorted(BODY)
    for key in BODY:
        assert torch.allclose(result.upload["params"][key], end[key], atol=1e-6), key
    assert sorted(result.state["params"]) == sorted(HEAD)
    for key in HEAD:
        assert torch.allclose(result.state["params"][key], middle[key], atol=1e-6), key
    assert int(result.state["steps"]) == 7 + 5
    assert result.weight == ctx.objective_weight(0, "samples")


def test_fedrep_head_phase_length_in_epochs_and_steps():
    data = digits_client(0)
    ctx = make_ctx()
    ctx.batch_size = 16
    task = ClientTask(0, data, [], 0.05, 1)
    epoch = math.ceil(data.num_train / 16)
    assert build_algorithm({"name": "fedrep"}, ctx).head_phase_steps(task) == 10 * epoch
    algo = build_algorithm({"name": "fedrep", "head_epochs": 2}, ctx)
    assert algo.head_phase_steps(task) == 2 * epoch
    algo = build_algorithm({"name": "fedrep", "head_steps": 3}, ctx)
    assert algo.head_phase_steps(task) == 3
    ctx.batch_size = None  # full batch: one step per epoch
    algo = build_algorithm({"name": "fedrep", "head_epochs": 2}, ctx)
    assert algo.head_phase_steps(task) == 2


def test_fedrep_without_head_steps_never_changes_the_head():
    result = run({"name": "fedrep", "head_steps": 0}, clients_per_round=None)
    init = initial_params()
    for c in TRAINED:
        for key in HEAD:
            assert torch.equal(result.client_params[c][key], init[key]), (c, key)
        assert (flat(result.client_params[c], BODY) - flat(init, BODY)).abs().max() > 1e-3


# -- the head phase on the frozen body's features (algorithms/frozen_body.py) ---------------
def count_feature_tables(monkeypatch) -> list[int]:
    """Each feature table FedRep makes, by its number of rows."""
    import fedloom.algorithms.fedrep as fedrep

    made: list[int] = []
    real = fedrep.body_features

    def spy(*args):
        table = real(*args)
        made.append(int(table.shape[0]))
        return table

    monkeypatch.setattr(fedrep, "body_features", spy)
    return made


@pytest.mark.parametrize("executor", ["sequential", "vectorized"])
def test_fedrep_head_epochs_train_on_the_frozen_bodys_features(executor, monkeypatch):
    """With head_epochs the head phase reads a feature table made once per client and round;
    the run equals the one that runs the whole model at every head step (measured: 6.0e-8
    sequential, 2.4e-7 vectorized, float32)."""
    import fedloom.algorithms.fedrep as fedrep

    algorithm = {"name": "fedrep", "head_epochs": 3}
    executors = {"sequential": {"kind": "sequential"}, "vectorized": {"kind": "vectorized"}}
    config = digits_config(algorithm, clients_per_round=None)
    config["executor"] = executors[executor]
    made = count_feature_tables(monkeypatch)
    tables = fedloom.run(config, write=False, progress=False)
    trained = parse_config(config)
    sizes = load_dataset(trained.data, trained.seed).clients
    assert sorted(made) == sorted(sizes[c].num_train for c in range(5) for _ in range(3))
    made.clear()
    monkeypatch.setattr(fedrep, "frozen_body_head", lambda *args: None)
    whole = fedloom.run(config, write=False, progress=False)
    assert not made
    gap = max(
        float((tables.client_params[c][key] - value).abs().max())
        for c, params in whole.client_params.items()
        for key, value in params.items()
    )
    assert gap <= 1e-6
    moved = flat(whole.client_params[0], HEAD) - flat(initial_params(), HEAD)
    assert moved.abs().max() > 1e-2


class HeadThenScale(FedModel):
    """Something after the head: its output is not the head's."""

    head_modules = ("head",)

    def __init__(self) -> None:
        super().__init__()
        self.body, self.head = torch.nn.Linear(64, 16), torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 2.0 * self.head(torch.relu(self.body(x.flatten(1))))


class TwoPartHead(FedModel):
    head_modules = ("fc", "head")

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(64, 16)
        self.fc, self.head = torch.nn.Linear(16, 16), torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.fc(torch.relu(self.body(x.flatten(1)))))


class WithLayer(FedModel):
    """A body with one extra layer (dropout or batch normalization) before a linear head."""

    head_modules = ("head",)

    def __init__(self, layer: torch.nn.Module) -> None:
        super().__init__()
        self.body, self.layer, self.head = torch.nn.Linear(64, 16), layer, torch.nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(torch.relu(self.body(x.flatten(1)))))


@pytest.mark.parametrize(
    ("make", "head"),
    [
        (lambda: WithLayer(torch.nn.Identity()), "head"),
        (lambda: WithLayer(torch.nn.Dropout(0.5)), None),  # new masks every step
        (lambda: WithLayer(torch.nn.BatchNorm1d(16)), None),  # the minibatch's statistics
        (HeadThenScale, None),
        (TwoPartHead, None),
    ],
)
def test_the_feature_table_only_where_it_leaves_the_steps_unchanged(make, head):
    from fedloom.algorithms.frozen_body import frozen_body_head

    model = FunctionalModel(make(), "classification")
    params, buffers = model.initial_state(0)
    keys = model.module.head_keys()
    assert frozen_body_head(model, keys, params, buffers, torch.zeros(1, 1, 8, 8)) == head


@pytest.mark.parametrize(
    "setting", ["head_steps", "augmentation", "head_epochs"], ids=lambda s: s.replace("_", "-")
)
def test_fedrep_without_whole_head_epochs_or_with_augmentation_runs_the_whole_model(setting):
    from fedloom.data.augment import Augmenter, AugmentSpec

    data, ctx = digits_client(0), make_ctx()
    algorithm = (
        {"name": "fedrep", "head_steps": 4} if setting == "head_steps" else {"name": "fedrep"}
    )
    algo = build_algorithm(algorithm, ctx)
    server = algo.init_server_state(*ctx.model.initial_state(0))
    program = client_program(algo)
    if setting == "augmentation":
        program.augment = Augmenter(AugmentSpec(), 0)
    task = ClientTask(0, data, ctx.make_plan(data, 3, "batches", 1, 0), 0.05, 1)
    plans = program.plans(algo.server_message(server), algo.init_client_state(server, 0), task)
    table = plans["fedrep/head"].inputs
    if setting == "head_epochs":
        assert table is not None and table.shape == (data.num_train, 200)
    else:
        assert table is None and program.feature_head is None


# -- configuration ---------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("algorithm", "key"),
    [
        ({"name": "fedrep", "head_steps": -1}, "algorithm.head_steps"),
        ({"name": "fedrep", "head_epochs": -1}, "algorithm.head_epochs"),
        ({"name": "fedrep", "head_epochs": 2, "head_steps": 5}, "algorithm.head_steps"),
        ({"name": "fedrep", "weighting": "size"}, "algorithm.weighting"),
    ],
)
def test_invalid_hyperparameters_name_the_key(algorithm, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        run(algorithm)


# -- learning on the shared personalized setup (tests/algorithms/pfl_setup.py) -------------
@pytest.mark.slow
def test_fedrep_beats_fedavg_on_label_shards(data_root):
    # 10 head steps before the round's 20 body steps (the paper's 10 head epochs would be ~90
    # steps here, 5x the run time). Measured (seed 0): personalized mean 0.9527, P10 0.8845
    # (0.9597 / 0.9078 with 20 head steps); FedAvg's global model on the same clients 0.6215.
    result = run_pfl({"name": "fedrep", "head_steps": 10})
    accuracy = result.summary["final"]["personalized"]["accuracy_mean"]
    assert accuracy >= fedavg_accuracy_on_clients() + 0.30, accuracy
