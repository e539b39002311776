"""Two rounds on Flower's simulation engine (Ray backend) give fedloom's own engine's model, for
FedAvg and SCAFFOLD (its control variates kept on the nodes across rounds), within 1e-5."""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip(
    "flwr", reason="the Flower adapter needs its extra: pip install 'fedloom[flower]'"
)

import fedloom
from fedloom.engine.sampling import sample_clients
from fedloom.flower import run_simulation

pytestmark = pytest.mark.ray  # run apart from the parallel tests (scripts/test.sh)

ray = pytest.importorskip("ray", reason="Flower's simulation runs on Ray (flwr[simulation])")

TOL = 1e-5
CLIENTS, PER_ROUND, ROUNDS = 4, 3, 2
BASE: dict[str, Any] = {
    "seed": 1,
    "data": {
        "name": "digits",
        "num_clients": CLIENTS,
        "partition": {"kind": "dirichlet", "alpha": 0.5},
    },
    "model": {"name": "mlp"},
    "train": {
        "rounds": ROUNDS,
        "clients_per_round": PER_ROUND,  # some clients train in both rounds, some in one
        "local_epochs": 1,
        "batch_size": 20,
        "lr": 0.05,
        "stragglers": 0.4,  # one straggler a round: the server decides each node's steps
    },
    "eval": {"every": 1},
    "executor": {"kind": "sequential"},
}


@pytest.fixture(scope="module", autouse=True)
def no_ray_left_behind() -> Iterator[None]:
    """Flower's simulation starts Ray and must leave none running (the Ray executor's tests
    start their own)."""
    assert not ray.is_initialized()
    yield
    assert not ray.is_initialized()


def config(algorithm: str) -> dict[str, Any]:
    return {**copy.deepcopy(BASE), "algorithm": {"name": algorithm}}


@pytest.mark.parametrize("algorithm", ["fedavg", "scaffold"])
def test_flower_simulation_equals_the_engine(algorithm: str) -> None:
    cfg = config(algorithm)
    engine = fedloom.run(cfg, write=False, progress=False)
    # SCAFFOLD on two Ray actors: a node's context (its control variate) moves between
    # processes; FedAvg on one (faster start)
    flower = run_simulation(cfg, num_cpus=2, client_cpus=1.0 if algorithm == "scaffold" else 2.0)

    assert engine.global_params is not None and flower.global_params is not None
    assert engine.global_params.keys() == flower.global_params.keys()
    for key, value in engine.global_params.items():
        diff = (value - flower.global_params[key]).abs().max().item()
        assert diff <= TOL, f"{algorithm} {key}: max |diff| {diff}"
    moved = max(
        (engine.global_params[k] - v).abs().max().item()
        for k, v in fedloom.run(
            {**cfg, "train": {**cfg["train"], "rounds": 1}}, write=False, progress=False
        ).global_params.items()  # type: ignore[union-attr]
    )
    assert moved > 100 * TOL  # the second round changed the model: a real comparison
    for a, b in zip(engine.history, flower.history, strict=True):
        assert a["global"]["accuracy"] == pytest.approx(b["global"]["accuracy"], abs=1e-9)
        assert a["global"]["loss"] == pytest.approx(b["global"]["loss"], abs=1e-5)
    assert flower.summary["communication"] == engine.summary["communication"]
    assert flower.summary["executor"] == "flower"

    stats = flower.extras["flower"]
    sampled = [sample_clients(BASE["seed"], r, list(range(CLIENTS)), PER_ROUND) for r in (1, 2)]
    assert stats["nodes"] == CLIENTS
    assert stats["messages"] == ROUNDS * PER_ROUND
    if algorithm == "scaffold":
        # each client's control variate went down once, then lived on its node
        assert set(sampled[0]) & set(sampled[1]), "the test needs a client in both rounds"
        assert stats["states_sent"] == len(set(sampled[0]) | set(sampled[1]))
        assert stats["states_sent"] < stats["messages"]
    else:
        assert stats["states_sent"] == 0
    assert torch.isfinite(torch.cat([v.flatten() for v in flower.global_params.values()])).all()
