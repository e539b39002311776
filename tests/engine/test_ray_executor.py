"""The Ray executor on a real two-node Ray cluster (two ``ray start`` processes on 127.0.0.1):
same numbers as the sequential executor for every algorithm, work on both nodes, the message
in the object store once per round, a runtime of its own without an address, clear errors."""

from __future__ import annotations

import copy
import pickle
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

import fedloom
from fedloom.algorithms import ALGORITHMS
from fedloom.config import parse_config
from fedloom.core.protocol import ClientData
from fedloom.engine import factory
from fedloom.engine.ray_executor import RayExecutor, balanced_groups, compact, compact_client
from fedloom.errors import ConfigError
from tests.conftest import metrics_without_time
from tests.engine.ray_cluster import free_port, ray_cluster
from tests.engine.test_executor_equivalence import NEEDS_NORM_LAYERS

pytestmark = pytest.mark.ray  # run apart from the parallel tests (scripts/test.sh)

ray = pytest.importorskip("ray")

ROUNDS = 3
BASE: dict[str, Any] = {
    "seed": 0,
    "data": {"name": "digits", "num_clients": 8, "partition": {"kind": "dirichlet", "alpha": 0.5}},
    "model": {"name": "mlp"},
    "train": {
        "rounds": ROUNDS,
        "clients_per_round": 5,
        "local_epochs": 1,
        "batch_size": 20,
        "stragglers": 0.4,
    },
    "eval": {"every": 3},
}
TOL = 1e-4
HYPER: dict[str, dict[str, Any]] = {"fedprox": {"mu": 0.1}, "fedavg_ft": {"finetune_steps": 4}}


def config(algorithm: str, executor: dict[str, Any]) -> dict[str, Any]:
    cfg = copy.deepcopy(BASE)
    cfg["algorithm"] = {"name": algorithm, **HYPER.get(algorithm, {})}
    cfg["executor"] = executor
    if algorithm in NEEDS_NORM_LAYERS:
        cfg["model"] = {"name": "cnn_bn"}
    return cfg


_sequential: dict[str, fedloom.RunResult] = {}


def sequential(algorithm: str) -> fedloom.RunResult:
    """The reference run (cached: several tests compare against it)."""
    if algorithm not in _sequential:
        cfg = config(algorithm, {"kind": "sequential"})
        _sequential[algorithm] = fedloom.run(cfg, write=False, progress=False)
    return _sequential[algorithm]


def assert_close(a: Any, b: Any, where: str = "") -> None:
    """Nested dicts/lists of numbers and tensors equal within TOL."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_close(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_close(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.shape == b.shape, where
        assert torch.allclose(a, b, atol=TOL, rtol=0), f"{where}: max |diff| {(a - b).abs().max()}"
    elif isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= TOL, f"{where}: {a} != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def assert_same_run(ray_run: Any, seq_run: Any) -> None:
    assert ray_run.summary["executor"] == "ray"
    assert ray_run.client_params.keys() == seq_run.client_params.keys()
    assert_close(ray_run.client_params, seq_run.client_params, "client_params")
    assert_close(
        metrics_without_time(ray_run.history), metrics_without_time(seq_run.history), "history"
    )
    assert_close(ray_run.global_params, seq_run.global_params, "global_params")


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    """A real local Ray cluster: a head node and one worker node, one CPU each."""
    started = time.perf_counter()
    with ray_cluster(nodes=2, cpus_per_node=1) as address:
        print(f"Ray test cluster at {address} up in {time.perf_counter() - started:.1f} s")
        yield address
    assert not ray.is_initialized()


class Recorded:
    """Every RayExecutor the runs make, and every ``ray.put``."""

    def __init__(self) -> None:
        self.executors: list[RayExecutor] = []
        self.puts: list[type] = []


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch) -> Recorded:
    rec = Recorded()

    class RecordingExecutor(RayExecutor):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            rec.executors.append(self)

    real_put = ray.put

    def put(value: Any, *args: Any, **kwargs: Any) -> Any:
        rec.puts.append(type(value))
        return real_put(value, *args, **kwargs)

    monkeypatch.setattr(factory, "RayExecutor", RecordingExecutor)  # the one place it is made
    monkeypatch.setattr(ray, "put", put)
    return rec


RAY_CHEAP = {"fedavg", "scaffold", "ditto", "fedbn"}
"""Run by default: the plain average, server and client control variates, personal models kept
on the workers, local BatchNorm layers (cnn_bn). Every other algorithm is a heavy test (2-7 s
each on a loaded 2-core machine, over a minute for them all); tests/engine/
test_executor_equivalence.py checks every algorithm on every other executor by default."""


@pytest.mark.parametrize(
    "algorithm",
    [
        pytest.param(name, marks=() if name in RAY_CHEAP else pytest.mark.heavy(budget=30))
        for name in ALGORITHMS.names()
    ],
)
def test_ray_equals_sequential(cluster: str, recorded: Recorded, algorithm: str) -> None:
    executor = {"kind": "ray", "address": cluster, "workers": 2}
    result = fedloom.run(config(algorithm, executor), write=False, progress=False)
    assert_same_run(result, sequential(algorithm))
    assert not ray.is_initialized(), "the executor connected, so it must disconnect"

    (ex,) = recorded.executors
    assert ex.message_puts == ROUNDS
    # the data once, the algorithm once, then one message per round
    assert recorded.puts[0] is dict  # every client's data, by client id
    assert len(recorded.puts) == 2 + ROUNDS, recorded.puts
    assert len(set(ex.actor_nodes)) == 2, "one worker on each node"
    assert len(ex.round_nodes) == ROUNDS
    if algorithm != "centralized":  # 5 clients a round: both workers get some
        assert all(len(set(nodes)) == 2 for nodes in ex.round_nodes), ex.round_nodes
    else:  # one pooled client
        assert all(len(nodes) == 1 for nodes in ex.round_nodes)


PRIVATE: dict[str, dict[str, Any]] = {
    "sample_dp": {"privacy": {"kind": "sample_dp", "noise_multiplier": 1.0}},
    "client_dp_secagg_plus": {
        "privacy": {"kind": "client_dp", "noise_multiplier": 0.5, "clip": 0.5},
        "secure_aggregation": {"kind": "secagg_plus"},
        "train": {**BASE["train"], "dropout": 0.2},
    },
}


@pytest.mark.parametrize("setting", sorted(PRIVATE))
def test_private_runs_equal_sequential(cluster: str, setting: str) -> None:
    """DP-SGD's per-client noise streams, DP-FedAvg's server noise and secure aggregation give
    the same run on Ray as in this process."""
    runs = {}
    for name, executor in (
        ("ray", {"kind": "ray", "address": cluster, "workers": 2}),
        ("sequential", {"kind": "sequential"}),
    ):
        cfg = {**config("fedavg", executor), **PRIVATE[setting]}
        runs[name] = fedloom.run(cfg, write=False, progress=False)
    assert_same_run(runs["ray"], runs["sequential"])
    assert runs["ray"].summary["privacy"] == runs["sequential"].summary["privacy"]


def test_vectorized_inside_workers(cluster: str, recorded: Recorded) -> None:
    executor = {"kind": "ray", "address": cluster, "workers": 2, "chunk_size": 2}
    result = fedloom.run(config("fedprox", executor), write=False, progress=False)
    assert_same_run(result, sequential("fedprox"))


def test_reuses_an_initialized_ray(cluster: str) -> None:
    ray.init(address=cluster, logging_level="WARNING")
    try:
        cfg = config("fedavg", {"kind": "ray", "workers": 2})
        result = fedloom.run(cfg, write=False, progress=False)
        assert ray.is_initialized(), "Ray was started by the caller: the executor leaves it on"
        assert_same_run(result, sequential("fedavg"))
    finally:
        ray.shutdown()


def test_too_many_workers_for_the_cluster(cluster: str) -> None:
    cfg = config("fedavg", {"kind": "ray", "address": cluster, "workers": 5})
    with pytest.raises(ConfigError, match=r"executor\.workers: 5 workers.*has 2"):
        fedloom.run(cfg, write=False, progress=False)
    assert not ray.is_initialized()


def test_local_runtime_without_address(monkeypatch: pytest.MonkeyPatch) -> None:
    # a new local Ray sets RAY_AUTH_MODE=token in os.environ: undo that after the test
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert not ray.is_initialized()
    cfg = config("local", {"kind": "ray", "workers": 2})
    result = fedloom.run(cfg, write=False, progress=False)
    assert not ray.is_initialized(), "the executor started Ray, so it must shut it down"
    assert_same_run(result, sequential("local"))


def test_unreachable_address_names_it() -> None:
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    started = time.perf_counter()
    cfg = config("fedavg", {"kind": "ray", "address": address})
    with pytest.raises(ConfigError, match=rf"executor\.address: cannot connect .*'{address}'"):
        fedloom.run(cfg, write=False, progress=False)
    assert time.perf_counter() - started < 30
    assert not ray.is_initialized()


def test_malformed_address() -> None:
    cfg = config("fedavg", {"kind": "ray", "address": "head-node"})
    with pytest.raises(ConfigError, match=r"executor\.address: 'head-node' is not HOST:PORT"):
        fedloom.run(cfg, write=False, progress=False)


def test_cuda_is_not_supported_yet() -> None:
    with pytest.raises(ConfigError, match=r"executor\.device: 'cuda' is not supported"):
        parse_config({"executor": {"kind": "ray", "device": "cuda"}})  # checked at parse time


def test_missing_ray_says_how_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(ConfigError, match=r"pip install 'fedloom\[ray\]'"):
        parse_config({"executor": {"kind": "ray"}})


@pytest.mark.parametrize(
    ("weights", "groups", "expected"),
    [
        ([5, 5, 5, 5, 5], 2, [[0, 1, 2], [3, 4]]),
        ([1, 1, 1, 10], 2, [[0, 1, 2], [3]]),
        ([10, 1, 1, 1], 3, [[0], [1, 2], [3]]),
        ([1, 1, 1, 1, 1, 1], 4, [[0, 1], [2, 3], [4], [5]]),
        ([3, 3], 4, [[0], [1]]),
        ([], 2, []),
    ],
)
def test_balanced_groups(weights: list[int], groups: int, expected: list[list[int]]) -> None:
    assert [list(r) for r in balanced_groups(weights, groups)] == expected


def test_compact_ships_views_at_their_own_size() -> None:
    full = torch.randn(1000, 8)
    view = full[10:20]  # pickling the view alone would write all 1000 rows
    out = compact({"a": [view, (full[:, 0],)], "b": full, "c": 3})
    assert len(pickle.dumps(out["a"][0])) < 2000 < len(pickle.dumps(view))
    assert torch.equal(out["a"][0], view) and torch.equal(out["a"][1][0], full[:, 0])
    assert out["b"] is full and out["c"] == 3  # nothing to compact: the same object
    client = compact_client(ClientData(full[:5], full[:5, 0], full[5:7], full[5:7, 0]))
    assert len(pickle.dumps(client)) < 4000
