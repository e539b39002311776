"""System heterogeneity: local work drawn per client and round, stragglers doing partial work or
dropping out, and the heavy-ball local solver, on every executor."""

from __future__ import annotations

import pytest
import torch

import fedloom
from fedloom.config import parse_config
from fedloom.core.functional import FunctionalModel
from fedloom.engine.workload import draw_work, full_budget, straggler_steps
from fedloom.errors import ConfigError
from fedloom.models import build_model
from fedloom.run_config.train import TrainConfig
from fedloom.solvers.local import local_sgd
from tests.engine.test_executor_equivalence import OTHER_EXECUTORS, assert_same, config


def spec(**kw):
    return TrainConfig(local_steps=kw).local_steps


def test_uniform_work_stays_in_range_and_uses_every_value():
    s = spec(kind="uniform", low=2, high=5)
    draws = [draw_work(s, 0, r, c) for r in range(1, 30) for c in range(10)]
    assert set(draws) == {2, 3, 4, 5}


def test_work_per_round_changes_and_per_client_does_not():
    per_round = spec(kind="uniform", low=1, high=50)
    per_client = spec(kind="uniform", low=1, high=50, per="client")
    assert len({draw_work(per_round, 0, r, 3) for r in range(1, 20)}) > 5
    assert len({draw_work(per_client, 0, r, 3) for r in range(1, 20)}) == 1
    assert len({draw_work(per_client, 0, 1, c) for c in range(20)}) > 5


def test_choice_follows_its_probabilities():
    s = spec(kind="choice", values=[1, 10], probs=[0.8, 0.2])
    draws = torch.tensor([draw_work(s, 0, r, c) for r in range(200) for c in range(10)])
    assert (draws == 1).float().mean() == pytest.approx(0.8, abs=0.03)


def test_per_client_values_and_epochs_become_steps():
    train = TrainConfig(local_epochs={"kind": "per_client", "values": [1, 3]}, batch_size=10)
    assert full_budget(train, 0, 1, 0, n=25) == 3  # 1 epoch of ceil(25/10) batches
    assert full_budget(train, 0, 1, 1, n=25) == 9
    with pytest.raises(ConfigError, match="per_client values has 2 entries"):
        full_budget(train, 0, 1, 2, n=25)


@pytest.mark.parametrize(
    "train, message",
    [
        ({"local_steps": {"kind": "uniform", "low": 5, "high": 2}}, "low <= high"),
        ({"local_steps": {"kind": "choice", "values": [1, 2], "probs": [0.5]}}, "one non-neg"),
        ({"local_steps": {"kind": "uniform", "lo": 2}}, "Did you mean 'train.local_steps.low'"),
        ({"local_epochs": {"kind": "normal"}}, "train.local_epochs.kind"),
        ({"local_steps": 0}, "train.local_steps: Input should be greater than 0"),
        ({"straggler_mode": "skip"}, "train.straggler_mode"),
    ],
)
def test_work_config_errors_name_the_key(train, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"algorithm": {"name": "fedavg"}, "train": train})


def test_stragglers_partial_or_dropped_are_the_same_clients():
    clients, full = list(range(10)), [20] * 10
    partial = straggler_steps(0, 3, clients, full, 0.5, "partial")
    dropped = straggler_steps(0, 3, clients, full, 0.5, "drop")
    stragglers = [i for i, s in enumerate(dropped) if s == 0]
    assert len(stragglers) == 5
    # the clients that do not straggle do all their work in both modes ...
    assert all(partial[i] == dropped[i] == 20 for i in range(10) if i not in stragglers)
    # ... and the same five straggle: a uniform 1..20 share of the work, or nothing
    assert all(1 <= partial[i] <= 20 for i in stragglers)
    assert any(partial[i] < 20 for i in stragglers)


def test_dropped_stragglers_send_nothing_and_are_not_aggregated():
    base = config("fedavg", "mlp", {"kind": "sequential"}, 16)
    base["train"]["stragglers"] = 0.4  # 2 of 5 sampled clients a round
    partial = fedloom.run(base, write=False, progress=False)
    base["train"]["straggler_mode"] = "drop"
    dropped = fedloom.run(base, write=False, progress=False)
    row_p, row_d = partial.history[0], dropped.history[0]
    assert (row_p["participants"], row_p["reported"]) == (5, 5)
    assert (row_d["participants"], row_d["reported"]) == (5, 3)
    # the model is sent to all 5, three uploads come back
    assert row_d["communication"]["bytes_down"] == row_p["communication"]["bytes_down"]
    assert row_d["communication"]["bytes_up"] * 5 == row_p["communication"]["bytes_up"] * 3


def test_every_client_dropped_keeps_the_server_model(monkeypatch):
    from fedloom.engine import workload

    def everyone_drops(seed, round, clients, full, fraction, mode):
        return [0] * len(clients)

    cfg = config("fedavg", "mlp", {"kind": "sequential"}, 16)
    cfg["train"]["rounds"] = 2
    init = fedloom.run({**cfg, "train": {**cfg["train"], "rounds": 1}}, write=False, progress=False)
    monkeypatch.setattr(workload, "straggler_steps", everyone_drops)
    result = fedloom.run(cfg, write=False, progress=False)
    assert all(row["reported"] == 0 for row in result.history)
    assert result.history[-1]["train_loss"] is None
    initial, _ = FunctionalModel(build_model("mlp", (64,), 10), "classification").initial_state(5)
    for key, value in initial.items():
        assert torch.equal(result.global_params[key], value)
    key = next(iter(initial))
    assert not torch.equal(init.global_params[key], initial[key])  # one round does move it


def test_heavy_ball_local_solver_equals_torch_sgd_with_momentum():
    torch.manual_seed(0)
    module = build_model("mlp", (64,), 10)
    model = FunctionalModel(module, "classification")
    params, buffers = model.initial_state(0)
    x, y = torch.randn(40, 64), torch.randint(0, 10, (40,))
    plan = [torch.arange(i, i + 8) for i in range(0, 40, 8)] * 2
    solved = local_sgd(model, params, buffers, x, y, plan, lr=0.1, momentum=0.9)

    reference = build_model("mlp", (64,), 10)
    reference.load_state_dict({**params, **buffers})
    opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    for idx in plan:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(reference(x[idx]), y[idx]).backward()
        opt.step()
    for key, value in reference.named_parameters():
        assert torch.allclose(solved.params[key], value.detach(), atol=1e-6), key


@pytest.mark.parametrize("executor", ["vectorized", "vectorized_tail", "processes"])
@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "fednova", "local_solver": "momentum"},
        {"name": "fednova", "local_solver": "proximal", "mu": 0.1},
        {"name": "scaffold", "option": "I"},
    ],
    ids=lambda a: "-".join(str(v) for v in a.values()),
)
def test_heterogeneous_work_is_equal_on_every_executor(executor, algorithm):
    """Per-client-and-round work, stragglers and momentum buffers carried into the vectorized
    executor's sequential tail give the sequential executor's numbers."""

    def cfg(kind: dict) -> dict:
        c = config("fedavg", "mlp", kind, 16)
        c["algorithm"] = algorithm
        c["train"].pop("local_epochs")
        c["train"]["local_steps"] = {"kind": "uniform", "low": 1, "high": 12}
        return c

    seq = fedloom.run(cfg({"kind": "sequential"}), write=False, progress=False)
    other = fedloom.run(cfg(OTHER_EXECUTORS[executor]), write=False, progress=False)
    assert_same(seq, other)
