"""The stacked per-client state store: round trips, lazy rows, mmap files, checkpoints."""

from __future__ import annotations

import resource

import torch

import fedloom
from fedloom.engine.state_store import ClientStateStore
from tests.conftest import metrics_without_time


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "params": {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g)},
        "buffers": {},
        "c": torch.randn(2, generator=g),
    }


def test_round_trip_and_absent_clients(tmp_path):
    for store in (ClientStateStore(5), ClientStateStore(5, "mmap", tmp_path)):
        assert 2 not in store and store.get(2) is None
        store.set(2, _state(2))
        store.set(4, None)
        got = store.get(2)
        assert torch.equal(got["params"]["w"], _state(2)["params"]["w"])
        assert got["buffers"] == {} and torch.equal(got["c"], _state(2)["c"])
        assert 4 in store and store.get(4) is None
        assert list(store) == [2, 4]
        stacked = store.stacked([2, 2])
        assert stacked["params"]["w"].shape == (2, 3, 4)
        store.set(4, _state(4))  # a state after None replaces it
        assert torch.equal(store.get(4)["c"], _state(4)["c"])
        store.set(4, None)
        assert store.get(4) is None


def test_many_at_once_equals_one_by_one(tmp_path):
    """set_many/get_many (the engine's per-round calls) against set/get client by client, with
    a None state, a client whose state lacks a path, and a state overwritten in the batch."""
    partial = {"params": {"w": torch.ones(3, 4), "b": torch.ones(4)}, "buffers": {}}
    clients = [3, 0, 1, 4]
    states = [_state(3), None, partial, _state(4)]
    for storage in ("memory", "mmap"):
        one, many = (
            ClientStateStore(5, storage, tmp_path / storage / name) for name in ("one", "many")
        )
        for c, st in zip(clients, states, strict=True):
            one.set(c, st)
        many.set_many(clients, states)
        many.set_many([3, 3], [_state(31), _state(30)])  # twice in a batch: the last wins
        one.set(3, _state(30))
        assert list(one) == list(many) == [0, 1, 3, 4]
        # all five (one unbind per table) and one of five (indexed one by one)
        assert torch.equal(many.get_many([3])[0]["c"], _state(30)["c"])
        pairs = zip(one.get_many(list(range(5))), many.get_many(list(range(5))), strict=True)
        for got_one, got_many in pairs:
            assert (got_one is None) == (got_many is None)
            if got_one is not None:
                for key in ("params", "buffers"):
                    assert got_one[key].keys() == got_many[key].keys()
                    for k in got_one[key]:
                        assert torch.equal(got_one[key][k], got_many[key][k])
        assert torch.equal(many.get(3)["c"], _state(30)["c"])
        assert torch.equal(many.get(1)["params"]["w"], torch.ones(3, 4))


def test_checkpoint_round_trip(tmp_path):
    store = ClientStateStore(3)
    store.set(0, _state(0))
    store.set(1, _state(1))
    torch.save(store.state_dict(), tmp_path / "s.pt")
    again = ClientStateStore(3, "mmap", tmp_path / "state")
    again.load_state_dict(torch.load(tmp_path / "s.pt"))
    for cid in (0, 1):
        assert torch.equal(again.get(cid)["params"]["b"], _state(cid)["params"]["b"])
    assert again.get(2) is None


def test_ten_thousand_2nn_sized_states_map_lazily(tmp_path):
    """10,000 clients x 199,210 float32 parameters = 8.0 GB of logical state; as mmap'd files
    only the rows written take memory (the full in-RAM figure is in benchmarks/state_memory.py)."""
    store = ClientStateStore(10_000, "mmap", tmp_path)
    shapes = {
        "fc1.weight": (200, 784),
        "fc1.bias": (200,),
        "fc2.weight": (200, 200),
        "fc2.bias": (200,),
        "fc3.weight": (10, 200),
        "fc3.bias": (10,),
    }
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    for cid in range(0, 10_000, 100):
        store.set(cid, {"params": {k: torch.full(s, float(cid)) for k, s in shapes.items()}})
    grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    assert store.nbytes() == 10_000 * 199_210 * 4
    assert grown < 400 * 2**20  # 100 rows written (80 MB), not 8 GB
    assert float(store.get(9_900)["params"]["fc3.bias"][0]) == 9_900.0
    assert store.get(9_901) is None


def test_local_training_resumes_with_mmap_state(tmp_path):
    config = {
        "data": {"name": "digits", "num_clients": 6},
        "model": {"name": "logreg"},
        "algorithm": {"name": "local"},
        "train": {"rounds": 4, "clients_per_round": 3, "local_steps": 3},
        "eval": {"every": 2},
        "checkpoint": {"every": 2},
        "state": {"storage": "mmap"},
        "executor": {"kind": "sequential"},
    }
    full = fedloom.run(config, out=tmp_path / "full", progress=False)
    assert (tmp_path / "full" / "state").is_dir()
    fedloom.run(
        {**config, "train": {**config["train"], "rounds": 2}}, out=tmp_path / "part", progress=False
    )
    # continue the 2-round run to 4 rounds from its checkpoint: same numbers as 4 rounds at once
    import yaml

    cfg_path = tmp_path / "part" / "config.yaml"
    raw = yaml.safe_load(cfg_path.read_text())
    raw["train"]["rounds"] = 4
    cfg_path.write_text(yaml.safe_dump(raw))
    # more rounds is a config change: accepted explicitly (docs/inputs.md, "Config drift")
    resumed = fedloom.run(resume=tmp_path / "part", accept_config_change=True, progress=False)
    assert metrics_without_time(resumed.history) == metrics_without_time(full.history)
    for cid, params in full.client_params.items():
        for key, value in params.items():
            assert torch.equal(value, resumed.client_params[cid][key])
