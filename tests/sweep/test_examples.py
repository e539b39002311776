"""examples/sweeps: PFLlib's leaderboard protocol (docs/benchmarks.md) as sweep files: their
structure, and every cell's config validated as `fedloom sweep` does before it runs anything."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedloom.data.spec import DATASETS
from fedloom.models import MODELS
from fedloom.sweep import load_spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "sweeps"
ALGORITHMS = ["fedavg", "ditto", "fedrep", "fedper", "apfl", "pfedme", "perfedavg"]


@pytest.mark.parametrize(
    ("file", "dataset"),
    [("pfllib_fmnist_dir01.yaml", "fashion_mnist"), ("pfllib_cifar10_dir01.yaml", "cifar10")],
)
def test_pfllib_protocol_specs(file, dataset):
    sweep = load_spec(EXAMPLES / file)
    assert list(sweep.grid) == ["algorithm"] and sweep.seeds == [0, 1, 2]
    assert [section["name"] for section in sweep.grid["algorithm"]] == ALGORITHMS
    assert {"name": "pfedme", "inner_lr": 0.01} in sweep.grid["algorithm"]  # PFLlib's -lrp
    base = sweep.base
    pooled = {"cifar10": {"pool": "all"}} if dataset == "cifar10" else {}  # PFLlib pools both
    assert base["data"] == {
        **pooled,
        "name": dataset,
        "num_clients": 20,
        "partition": {"kind": "dirichlet", "alpha": 0.1},
        "test_fraction": 0.25,
    }
    assert base["model"] == {"name": "cnn4"}
    assert base["train"] == {
        "rounds": 2000,
        "clients_per_round": None,
        "local_epochs": 1,
        "batch_size": 10,
        "lr": 0.005,
    }
    assert base["eval"]["every"] == 1  # the best round needs every round evaluated
    assert dataset in DATASETS.names() and base["model"]["name"] in MODELS.names()
    sweep.validate()


def test_the_cpu_measurement_is_the_fmnist_protocol_at_two_rounds_on_both_skews():
    """pfllib_fmnist_cpu.yaml, the table of docs/benchmarks.md: PFLlib's Fashion-MNIST protocol
    but for its rounds, over both label skews, every cell valid."""
    short, full = (
        load_spec(EXAMPLES / "pfllib_fmnist_cpu.yaml"),
        load_spec(EXAMPLES / "pfllib_fmnist_dir01.yaml"),
    )
    assert short.grid["algorithm"] == full.grid["algorithm"] and short.seeds == full.seeds
    assert short.grid["data.partition"] == [
        {"kind": "dirichlet", "alpha": 0.1},
        {"kind": "pathological", "classes_per_client": 2},
    ]
    assert short.base["train"] == {**full.base["train"], "rounds": 2}
    assert short.base["data"] == {k: v for k, v in full.base["data"].items() if k != "partition"}
    assert short.base["model"] == full.base["model"]
    short.validate()


LEADERBOARD = [
    *("moon", "fedbabu", "fedrod", "fedala", "feddbe", "fedas", "fedcp", "gpfl", "fedpac"),
    *("fedgh", "fedcac", "fedfomo", "fedamp", "apple", "cfl", "fedem"),
]


def test_the_leaderboard_sweep_is_the_fmnist_protocol_for_the_new_algorithms():
    """leaderboard_fmnist.yaml (docs/leaderboard_algorithms.md): the same protocol as
    pfllib_fmnist_dir01.yaml over both label skews, FedAvg, Ditto and FedRep beside the
    sixteen leaderboard algorithms, every cell valid."""
    sweep = load_spec(EXAMPLES / "leaderboard_fmnist.yaml")
    protocol = load_spec(EXAMPLES / "pfllib_fmnist_dir01.yaml").base
    names = [section["name"] for section in sweep.grid["algorithm"]]
    assert names == ["fedavg", "ditto", "fedrep", *LEADERBOARD]
    assert sweep.seeds == [0, 1, 2] and sweep.grid["data.partition"] == [
        {"kind": "dirichlet", "alpha": 0.1},
        {"kind": "pathological", "classes_per_client": 2},
    ]
    for section in ("model", "train", "eval"):
        assert sweep.base[section] == protocol[section], section
    assert {k: v for k, v in sweep.base["data"].items() if k != "partition"} == {
        k: v for k, v in protocol["data"].items() if k != "partition"
    }
    sweep.validate()
