"""A config is checked once, when it is parsed: the algorithm block by its algorithm's own
Config (the engine builds from that instance, never parsing again) and the client counts
whenever the config states ``data.num_clients``."""

from __future__ import annotations

import pytest

import fedloom
import fedloom.algorithms as algorithms
from fedloom.algorithms.fedprox import FedProxConfig
from fedloom.config import parse_config
from fedloom.data.federated import from_arrays
from fedloom.errors import ConfigError
from tests.engine.test_executor_equivalence import config


def test_the_algorithm_block_is_its_algorithms_config_with_defaults():
    cfg = parse_config({"algorithm": {"name": "fedprox"}})
    assert isinstance(cfg.algorithm, FedProxConfig)
    assert cfg.to_dict()["algorithm"] == FedProxConfig(name="fedprox").model_dump(mode="json")
    # a parsed config round-trips through its YAML form
    assert parse_config(cfg.to_dict()) == cfg


@pytest.mark.parametrize(
    ("algorithm", "message"),
    [
        ({"name": "fedprox", "mu": -1.0}, r"algorithm\.mu"),
        ({"name": "fedprox", "mew": 0.1}, r"algorithm\.mew: unknown key.*Allowed here: name, mu\b"),
        ({"name": "fedprocs"}, r"unknown algorithm 'fedprocs'.*fedprox"),
        ({"mu": 0.1}, r"algorithm\.name is required"),
    ],
)
def test_algorithm_errors_come_from_parsing_and_name_the_key(algorithm, message):
    with pytest.raises(ConfigError, match=message):
        parse_config({"algorithm": algorithm})


def test_the_engine_builds_the_algorithm_without_parsing_it_again(monkeypatch):
    cfg = parse_config(config("fedprox", "mlp", {"kind": "sequential"}, 16))
    calls: list[dict] = []
    original = algorithms.parse_algorithm_config

    def counting(raw):  # type: ignore[no-untyped-def]
        calls.append(raw)
        return original(raw)

    monkeypatch.setattr(algorithms, "parse_algorithm_config", counting)
    result = fedloom.run(cfg, write=False, progress=False)
    assert result.summary["algorithm"] == "fedprox"
    assert calls == []


def test_client_counts_are_checked_when_the_config_states_them():
    with pytest.raises(ConfigError, match=r"train\.clients_per_round: 9 is more than the 7"):
        parse_config(
            {
                "data": {"name": "digits", "num_clients": 8},
                "train": {"clients_per_round": 9},
                "eval": {"new_clients": 1},
            }
        )
    with pytest.raises(ConfigError, match=r"eval\.new_clients: 8 leaves no client"):
        parse_config({"data": {"name": "digits", "num_clients": 8}, "eval": {"new_clients": 8}})


def test_client_counts_of_data_handed_to_the_api_are_checked_against_that_data():
    import numpy as np

    rng = np.random.default_rng(0)
    data = from_arrays(
        [(rng.normal(size=(20, 4)).astype("float32"), rng.integers(0, 2, size=20)) for _ in "abc"]
    )
    raw = {"model": {"name": "logreg"}, "train": {"rounds": 1, "clients_per_round": 4}}
    with pytest.raises(ConfigError, match=r"train\.clients_per_round: 4 is more than the 3"):
        fedloom.run(raw, data=data, write=False, progress=False)
