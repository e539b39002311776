"""fedloom trees and the adapter's config through Flower's records, without a Flower run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytest.importorskip(
    "flwr", reason="the Flower adapter needs its extra: pip install 'fedloom[flower]'"
)

from flwr.app import Context, RecordDict

from fedloom.core.protocol import ClientResult
from fedloom.data import FederatedData, from_arrays
from fedloom.errors import ConfigError
from fedloom.flower import protocol
from fedloom.flower.client import partition_id
from fedloom.flower.records import decode_tree, drop_trees, encode_tree, get_trees, put_trees
from fedloom.flower.runtime import ConfigSource, client_runtime
from fedloom.flower.simulation import num_supernodes

BASE: dict[str, Any] = {
    "seed": 3,
    "data": {"name": "digits", "num_clients": 4, "partition": {"kind": "dirichlet", "alpha": 0.5}},
    "model": {"name": "logreg"},
    "algorithm": {"name": "scaffold"},
    "train": {"rounds": 2, "clients_per_round": 3, "local_epochs": 1, "batch_size": 20},
    "executor": {"kind": "sequential"},
}


def same(a: Any, b: Any) -> None:
    """Equal trees: same keys in the same order, bit-equal tensors of the same dtype."""
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a) == list(b)
        for k in a:
            same(a[k], b[k])
    elif isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    else:
        assert a == b and type(a) is type(b)


def test_tree_round_trip_keeps_keys_order_dtypes_and_non_tensor_leaves() -> None:
    gen = torch.Generator().manual_seed(0)
    tree = {
        "z.weight": torch.randn(3, 2, generator=gen),
        "a": {"steps": torch.tensor(7), "mu": torch.tensor(0.1, dtype=torch.float64)},
        "empty": {},
        "none": None,
        "lr": 0.05,
        "name": "x",
        "flag": True,
        "count": torch.arange(4, dtype=torch.int64),
    }
    same(tree, decode_tree(*encode_tree(tree)))
    decoded = decode_tree(*encode_tree(tree))
    decoded["z.weight"] += 1  # owns its memory
    assert not torch.equal(decoded["z.weight"], tree["z.weight"])


def test_named_trees_in_a_record_dict() -> None:
    message = {"params": {"w": torch.ones(2)}, "buffers": {}, "control": {"w": torch.zeros(2)}}
    content = RecordDict()
    put_trees(content, "message", message)
    same(message, get_trees(content, "message"))
    assert get_trees(content, "state") is None
    drop_trees(content, "message")
    assert len(content) == 0


def test_unsupported_leaves_are_named() -> None:
    with pytest.raises(TypeError, match="'a/b' is a list"):
        encode_tree({"a": {"b": [1, 2]}})
    with pytest.raises(ValueError, match="contains '/'"):
        encode_tree({"a/b": torch.ones(1)})


def test_reply_round_trip() -> None:
    result = ClientResult(
        {"delta": {"w": torch.ones(3)}, "buffers": {}},
        weight=0.25,
        loss=1.5,
        state={"control": {"w": torch.full((3,), 2.0)}},
        info={"sparsity": 0.5},
        client_id=2,
        round=7,
    )
    back = protocol.read_reply(protocol.reply_content(result))
    same(result.upload, back.upload)
    same(result.state, back.state)
    assert (back.weight, back.loss, back.info, back.client_id, back.round) == (
        0.25,
        1.5,
        {"sparsity": 0.5},
        2,
        7,
    )


def test_run_config_keys_override_the_fedloom_config() -> None:
    source = ConfigSource.of(BASE)
    cfg = source.resolve({"fedloom.train.rounds": 5, "fedloom.algorithm.option": "I", "x": 1})
    assert cfg.train.rounds == 5 and cfg.algorithm.option == "I"  # type: ignore[attr-defined]
    assert source.resolve({}).train.rounds == 2


def test_run_config_keys_keep_what_the_config_dict_wrote() -> None:
    """A dict's partition and algorithm keys stay when the run config switches the dataset or
    algorithm (config.apply_overrides); only the default experiment's are replaced."""
    raw = {**BASE, "data": {**BASE["data"], "name": "mnist"}, "algorithm": {"mu": 0.5}}
    cfg = ConfigSource.of(raw).resolve(
        {"fedloom.data.name": "digits", "fedloom.algorithm.name": "fedprox"}
    )
    partition = cfg.data.partition or {}
    assert cfg.data.name == "digits" and (partition["kind"], partition["alpha"]) == (
        "dirichlet",
        0.5,
    )
    assert cfg.algorithm.name == "fedprox" and cfg.algorithm.mu == 0.5  # type: ignore[attr-defined]
    with pytest.raises(
        ConfigError, match=r"^algorithm\.mu: not a key of algorithm 'fedavg' \(written"
    ):
        ConfigSource.of(raw).resolve({"fedloom.algorithm.name": "fedavg"})
    default = ConfigSource.of(None).resolve({"fedloom.algorithm.name": "fedprox"})
    assert default.algorithm.name == "fedprox" and not hasattr(default.algorithm, "finetune_steps")


def test_bad_inputs_are_config_errors() -> None:
    vertical = {"data": {"name": "breast_cancer", "partition": {"kind": "vertical"}}}
    with pytest.raises(ConfigError, match="vertical"):
        ConfigSource.of(vertical)
    with pytest.raises(ConfigError, match="zero-argument callable"):
        ConfigSource.of(BASE, data=object())  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="partition-id"):
        partition_id(
            Context(run_id=1, node_id=1, node_config={}, state=RecordDict(), run_config={})
        )


def test_client_builds_the_engines_work_orders() -> None:
    """The node's plan (rebuilt from the seed) is the plan the engine gives the client."""
    runtime = client_runtime(ConfigSource.of(BASE), {})
    engine = runtime.engine
    for round in (1, 2):
        clients = engine.training.sample(engine.config.seed, round)
        for task in engine.tasks_for_round(round, clients):
            mine = runtime.task(task.client_id, round, len(task.plan), task.full)
            assert mine.data is task.data and mine.lr == task.lr and mine.full == task.full
            assert len(mine.plan) == len(task.plan) > 0
            assert all(torch.equal(a, b) for a, b in zip(mine.plan, task.plan, strict=True))
    with pytest.raises(ConfigError, match="not a training client"):
        runtime.task(9, 1, 1, None)


def _own_data() -> FederatedData:
    gen = torch.Generator().manual_seed(0)
    return from_arrays(
        [(torch.randn(n, 5, generator=gen), torch.randn(n, generator=gen)) for n in (30, 40, 50)]
    )


def _own_model() -> torch.nn.Module:
    return torch.nn.Linear(5, 1)


def test_own_data_and_model_factories_build_the_node_runtime() -> None:
    cfg = {
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": 1, "local_steps": 3, "batch_size": 8},
    }
    source = ConfigSource.of(cfg, data=_own_data, model=_own_model)
    assert num_supernodes(source) == 3
    runtime = client_runtime(source, {})
    task = runtime.task(2, 1, 3, 3)
    assert task.data.num_train == 40 and len(task.plan) == 3  # 50 samples, 20% held out
    message = {"params": {k: v.detach() for k, v in _own_model().named_parameters()}, "buffers": {}}
    (result,) = runtime.executor.run_round(runtime.engine.algorithm, message, [task], [None])
    assert result.weight == 40 and result.upload["params"]["weight"].shape == (1, 5)
