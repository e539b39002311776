"""Vertical runs through the shared run shell (engine/shell.py): checkpoints every
``checkpoint.every`` iterations (trees), and a run killed after one and resumed equals the
uninterrupted run bit for bit (docs/vertical.md, Checkpoints and resume)."""

from __future__ import annotations

import json

import numpy as np
import pytest

import fedloom
from fedloom.api import run_kind
from fedloom.errors import ConfigError
from tests.conftest import metrics_without_time
from tests.resume import Crash, crash_after


def _cfg(algorithm: dict, every: int = 2) -> dict:
    return {
        "kind": "vertical",
        "seed": 1,
        "data": {
            "name": "breast_cancer",
            "partition": {"kind": "vertical", "parties": [[0, 15], [15, 30]]},
        },
        "algorithm": algorithm,
        "eval": {"every": 1},
        "checkpoint": {"every": every, "keep": 2},
    }


ALGORITHMS = [
    {"name": "vertical_logistic", "iterations": 6, "batch_size": 64},
    {"name": "vertical_logistic", "iterations": 6, "protocol": "two_party"},
    {"name": "secureboost", "n_trees": 4, "max_depth": 2},
]


def _without_time(rows: list[dict]) -> list[dict]:
    rows = metrics_without_time(rows)
    for row in rows:
        row["vertical"].pop("seconds_encryption", None)
    return rows


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: a["name"] + a.get("protocol", ""))
def test_killed_and_resumed_equals_uninterrupted(tmp_path, algorithm):
    _check_resume(tmp_path, _cfg(algorithm))


WINE_3 = {"name": "wine", "partition": {"kind": "vertical", "parties": [[0, 5], [5, 9], [9, 13]]}}
BREAST_3 = {
    "name": "breast_cancer",
    "partition": {"kind": "vertical", "parties": [[0, 10], [10, 20], [20, 30]]},
}
NEW_PATHS = {
    "multiclass_two_hosts": (WINE_3, {"name": "secureboost", "n_trees": 4, "max_depth": 2}),
    "missing_values": ({**BREAST_3, "missing_fraction": 0.2},
                       {"name": "secureboost", "n_trees": 4, "max_depth": 2}),
    "logistic_two_hosts": (BREAST_3, {"name": "vertical_logistic", "iterations": 6,
                                      "batch_size": 64}),
}  # fmt: skip


@pytest.mark.parametrize("case", list(NEW_PATHS))
def test_new_paths_killed_and_resumed(tmp_path, case):
    """Multi-class SecureBoost and missing values with two hosts, and logistic regression
    with two hosts: resumed == uninterrupted."""
    data, algorithm = NEW_PATHS[case]
    cfg = {**_cfg(algorithm), "data": data}
    full = _check_resume(tmp_path, cfg)
    assert full.summary["num_clients"] == 3
    assert set(full.summary["vertical"]["bytes_by_party"]) >= {"guest", "host:1", "host:2"}
    if case == "multiclass_two_hosts":
        assert full.extras["model"].train_margin_.shape[1] == 3


def _check_resume(tmp_path, cfg: dict):
    """Run ``cfg`` uninterrupted, killed after 3 rounds (checkpoint every 2) and resumed:
    equal metrics, model, summary and bytes. Returns the uninterrupted run."""
    algorithm = cfg["algorithm"]
    full = fedloom.run(cfg, out=tmp_path / "full")
    with pytest.raises(Crash), crash_after(3):  # checkpoint: 2
        fedloom.run(cfg, out=tmp_path / "killed")
    saved = sorted(p.name for p in (tmp_path / "killed" / "checkpoints").glob("*.json"))
    assert saved == ["round_000002.json"]
    resumed = fedloom.run(resume=tmp_path / "killed")
    assert _without_time(resumed.history) == _without_time(full.history)
    rows = [json.loads(line) for line in (tmp_path / "killed" / "metrics.jsonl").open()]
    assert _without_time(rows) == _without_time(full.history)
    a, b = full.extras["model"], resumed.extras["model"]
    if algorithm["name"] == "secureboost":
        assert [t.to_dict() for t in a.trees_] == [t.to_dict() for t in b.trees_]
        assert np.array_equal(a.train_margin_, b.train_margin_)
    else:
        assert all(np.array_equal(x, y) for x, y in zip(a.coef_, b.coef_, strict=True))
        assert a.intercept_ == b.intercept_ and a.loss_history_ == b.loss_history_
    fa, fb = full.summary["final"], resumed.summary["final"]
    assert fa == fb
    assert full.summary["communication"] == resumed.summary["communication"]
    assert set(full.summary) == set(resumed.summary)
    return full


def test_checkpoints_every_and_last(tmp_path):
    result = fedloom.run(_cfg(ALGORITHMS[0], every=4), out=tmp_path / "run")
    names = sorted(p.name for p in (tmp_path / "run" / "checkpoints").glob("*.json"))
    assert names == ["round_000004.json", "round_000006.json"]
    assert result.run_dir is not None


@pytest.mark.parametrize("protocol", ["ahe", "secret_sharing"])
def test_ftl_killed_and_resumed_equals_uninterrupted(tmp_path, protocol):
    """FTL's weights, last gradients, loss history and (secret sharing) the dealer's stream
    are checkpointed: the resumed run's metrics, weights and bytes equal the uninterrupted
    run's."""
    cfg = _cfg({"name": "ftl", "iterations": 6, "protocol": protocol})
    cfg["secure_aggregation"] = {"kind": "secret_sharing" if protocol != "ahe" else "none"}
    full = fedloom.run(cfg, out=tmp_path / "full")
    with pytest.raises(Crash), crash_after(3):
        fedloom.run(cfg, out=tmp_path / "killed")
    resumed = fedloom.run(resume=tmp_path / "killed")
    assert _without_time(resumed.history) == _without_time(full.history)
    a, b = full.extras["model"], resumed.extras["model"]
    assert all(np.array_equal(x, y) for x, y in zip(a.weights_, b.weights_, strict=True))
    assert a.loss_history_ == b.loss_history_
    assert full.summary["final"] == resumed.summary["final"]
    assert full.summary["communication"] == resumed.summary["communication"]


def test_kind_is_explicit_or_inferred_once():
    raw = _cfg(ALGORITHMS[0])
    assert run_kind(raw) == "vertical"
    assert run_kind({k: v for k, v in raw.items() if k != "kind"}) == "vertical"
    assert run_kind({"algorithm": {"name": "fedavg"}}) == "horizontal"
    assert run_kind({"kind": "rl", "algorithm": {"name": "pavg"}}) == "rl"
    with pytest.raises(ConfigError, match="kind"):
        run_kind({"kind": "diagonal"})
    with pytest.raises(ConfigError, match="unknown algorithm 'ftl'"):  # explicit kind wins
        fedloom.run({"kind": "horizontal", "algorithm": {"name": "ftl"}}, write=False)
