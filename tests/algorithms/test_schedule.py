"""Round schedules of the proximal coefficient (docs/cold_start.md, "Decaying the proximal
coefficient"): the formulas, and that FedProx, Ditto and pFedMe use in round t exactly the
coefficient the schedule gives for t."""

from __future__ import annotations

import math

import pytest
import torch

import fedloom
from fedloom.algorithms import AlgorithmContext, ClientTask, build_algorithm
from fedloom.algorithms.client import client_program
from fedloom.algorithms.schedule import Schedule
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.core.pytree import weighted_average
from fedloom.errors import ConfigError
from fedloom.models import MLP
from fedloom.solvers.local import PlanMaker
from fedloom.solvers.sequential import run_client

ROUNDS = 5


def test_schedule_values():
    assert Schedule().at(0.7, 3, ROUNDS) == 0.7
    linear = Schedule(kind="linear", min=0.01)
    cosine = Schedule(kind="cosine", min=0.01)
    for s in (linear, cosine):
        assert s.at(1.0, 1, ROUNDS) == 1.0 and math.isclose(s.at(1.0, ROUNDS, ROUNDS), 0.01)
        values = [s.at(1.0, t, ROUNDS) for t in range(1, ROUNDS + 1)]
        assert values == sorted(values, reverse=True)
    # the linear rule mu_max (1 - s) + mu_min s (docs/cold_start.md), and the cosine midpoint
    assert math.isclose(linear.at(1.0, 2, ROUNDS), 1.0 * 0.75 + 0.01 * 0.25)
    assert math.isclose(cosine.at(1.0, 3, ROUNDS), (1.0 + 0.01) / 2)
    assert math.isclose(cosine.at(1.0, 2, ROUNDS), 0.01 + 0.99 * (1 + math.cos(math.pi / 4)) / 2)
    assert linear.at(1.0, 1, 1) == 0.01  # a one-round run ends at mu_min


def ctx() -> AlgorithmContext:
    model = FunctionalModel(MLP((1, 4, 4), 3, hidden=8), "classification")
    return AlgorithmContext(
        model=model,
        seed=0,
        num_clients=2,
        lr=0.1,
        batch_size=8,
        aggregate=weighted_average,
        make_plan=PlanMaker(0, 8),
        rounds=ROUNDS,
        population={0: 24, 1: 24},
    )


def client() -> ClientData:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(24, 1, 4, 4, generator=gen)
    y = torch.randint(0, 3, (24,), generator=gen)
    return ClientData(x, y, x[:6], y[:6])


CASES = {
    "fedprox": ("mu", "mu_schedule", {}),
    "ditto": ("mu", "mu_schedule", {"personal_steps": 3}),
    "pfedme": ("lam", "lam_schedule", {"inner_steps": 2}),
}


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("kind", ["linear", "cosine"])
def test_round_t_uses_the_scheduled_coefficient(name, kind):
    key, schedule_key, extra = CASES[name]
    schedule = {"kind": kind, "min": 0.05}
    c = ctx()
    scheduled = build_algorithm({"name": name, key: 2.0, schedule_key: schedule, **extra}, c)
    data = client()
    for round in (1, 3, ROUNDS):
        value = Schedule(**schedule).at(2.0, round, ROUNDS)
        constant = build_algorithm({"name": name, key: value, **extra}, c)
        params, buffers = c.model.initial_state(0)
        results = []
        for algorithm in (scheduled, constant):
            server = algorithm.init_server_state(params, buffers)
            message = algorithm.server_message(server, round)
            plan = c.make_plan(data, 4, "batches", round, 0)
            task = ClientTask(0, data, plan, 0.1, round)
            state = algorithm.init_client_state(server, 0)
            results.append(run_client(client_program(algorithm), message, state, task))
        a, b = results
        for k in a.upload["params"]:
            assert torch.allclose(a.upload["params"][k], b.upload["params"][k], atol=1e-7)
        if a.state is not None:
            personal = a.state.get("personal", a.state)["params"]
            other = b.state.get("personal", b.state)["params"]
            for k in personal:
                assert torch.allclose(personal[k], other[k], atol=1e-7), (round, k)


def test_scheduled_fedprox_is_the_same_on_every_executor():
    config = {
        "seed": 1,
        "data": {"name": "digits", "num_clients": 6, "partition": {"kind": "iid"}},
        "model": {"name": "mlp"},
        "algorithm": {"name": "fedprox", "mu": 1.0, "mu_schedule": {"kind": "cosine"}},
        "train": {"rounds": 3, "clients_per_round": 4, "local_steps": 4, "batch_size": 16},
        "eval": {"every": 3},
    }
    runs = [
        fedloom.run({**config, "executor": {"kind": kind}}, write=False, progress=False)
        for kind in ("sequential", "vectorized")
    ]
    for k, v in runs[0].global_params.items():
        assert torch.allclose(v, runs[1].global_params[k], atol=1e-5)
    constant = fedloom.run(
        {**config, "algorithm": {"name": "fedprox", "mu": 1.0}}, write=False, progress=False
    )
    assert not torch.allclose(
        constant.global_params["fc1.weight"], runs[0].global_params["fc1.weight"]
    )


def test_unknown_schedule_is_refused():
    with pytest.raises(ConfigError, match="mu_schedule"):
        build_algorithm({"name": "fedprox", "mu_schedule": {"kind": "step"}}, ctx())
