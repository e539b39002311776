"""Vertical runs from YAML (issue #16's contract): each algorithm through ``fedloom.run`` into a
normal run directory with its report, the command line, config errors, and the data split."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from sklearn.datasets import load_breast_cancer
from sklearn.linear_model import LinearRegression
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

import fedloom
from fedloom.errors import ConfigError
from fedloom.vertical import SecureBoost
from fedloom.vertical.data import load_vertical
from tests.vertical.conftest import KEY_BITS

BREAST = {"name": "breast_cancer", "test_fraction": 0.3}
CONFIGS = {
    "vertical_linear": {
        "data": {"name": "diabetes",
                 "partition": {"kind": "vertical", "parties": [[5, 10], [0, 5]]}},
        "algorithm": {"name": "vertical_linear", "protocol": "three_party", "iterations": 60,
                      "lr": 0.3},
    },
    "vertical_logistic": {
        "data": {**BREAST, "partition": {"kind": "vertical", "parties": [[15, 30], [0, 15]]}},
        "algorithm": {"name": "vertical_logistic", "protocol": "two_party", "iterations": 2},
        "secure_aggregation": {"kind": "paillier", "key_bits": KEY_BITS},
    },
    "secureboost": {
        "data": {**BREAST, "partition": {"kind": "vertical", "parties": [[0, 10], [10, 30]]}},
        "algorithm": {"name": "secureboost", "n_trees": 10, "max_depth": 3, "eta": 0.3,
                      "max_bin": 32, "reg_lambda": 1.0, "gamma": 0.0, "min_child_weight": 1.0,
                      "base_score": None},
        "secure_aggregation": {"kind": "none"},
    },
    "ftl": {
        "data": {"name": "breast_cancer", "partition": {"kind": "vertical",
                                                        "parties": [[0, 15], [15, 30]]}},
        "algorithm": {"name": "ftl", "protocol": "secret_sharing", "iterations": 300},
        "secure_aggregation": {"kind": "secret_sharing"},
        "eval": {"every": 100},
    },
}  # fmt: skip


def _yaml(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize("name", list(CONFIGS))
def test_yaml_run_of_each_algorithm(tmp_path, name):
    cfg = CONFIGS[name]
    result = fedloom.run(_yaml(tmp_path, cfg), out=tmp_path / "run")
    run = tmp_path / "run"
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert summary == result.summary and rows == result.history
    assert saved["algorithm"]["name"] == name and saved["seed"] == 0
    algo = cfg["algorithm"]
    total = algo.get("n_trees", algo.get("iterations"))
    every = cfg.get("eval", {}).get("every", 1)
    assert [r["round"] for r in rows] == list(range(every, total + 1, every))
    assert summary["rounds"] == total and summary["num_clients"] == 2
    vert = summary["vertical"]
    assert set(vert["bytes_by_party"]) >= ({"guest", "host:1"} if name != "ftl"
                                           else {"source", "target"})  # fmt: skip
    assert all(v["sent"] > 0 for v in vert["bytes_by_party"].values() if v["sent"])
    comm = summary["communication"]
    assert comm["bytes_up"] + comm["bytes_down"] == sum(
        v["sent"] for v in vert["bytes_by_party"].values()
    )
    assert vert["seconds_encryption"] >= 0 and vert["seconds_other"] >= 0
    final = summary["final"]["global"]
    if name == "vertical_linear":  # RMSE in the target's units, near least squares
        data = load_vertical("diabetes", [[5, 10], [0, 5]], 0.3, 0)
        x_tr, x_te = np.hstack(data.train_parts), np.hstack(data.test_parts)
        mean, std = data.y_scale
        ls = LinearRegression().fit(x_tr, data.y_train * std + mean)
        rmse = np.sqrt(np.mean((ls.predict(x_te) - (data.y_test * std + mean)) ** 2))
        assert final["rmse"] == pytest.approx(rmse, rel=0.05)
        assert "coordinator" in vert["bytes_by_party"]
    else:
        assert final["accuracy"] >= (0.9 if name != "vertical_logistic" else 0.85)
        assert 0.5 < final["auc"] <= 1.0
    if name == "vertical_logistic":
        assert vert["key_bits"] == KEY_BITS and vert["seconds_encryption"] > 0
    if name == "secureboost":  # the run equals the Python API on the split
        x, y = load_breast_cancer(return_X_y=True)
        x_tr, x_te, y_tr, y_te = train_test_split(x, y, test_size=0.3, random_state=0, stratify=y)
        sc = StandardScaler().fit(x_tr)
        x_tr, x_te = sc.transform(x_tr), sc.transform(x_te)
        model = SecureBoost(10, 3, 0.3, 32).fit([x_tr[:, :10], x_tr[:, 10:]], y_tr)
        margin = model.predict_margin([x_te[:, :10], x_te[:, 10:]])
        assert final["accuracy"] == pytest.approx(np.mean((margin > 0) == (y_te == 1)))
        assert vert["leaves_per_tree"] == [t.n_leaves for t in model.trees_]
    html = (run / "report.html").read_text()
    for panel in ("vertical_progress", "vertical_bytes", "vertical_seconds"):
        assert f'id="{panel}"' in html


def test_command_line_run_and_errors(tmp_path):
    """``fedloom run CONFIG.yaml --set ...``: exit 0 and a run directory; a wrong key exits 2
    naming it (with a did-you-mean)."""
    cfg = {**CONFIGS["secureboost"], "algorithm": {"name": "secureboost", "n_trees": 2}}
    path = _yaml(tmp_path, cfg)
    ok = subprocess.run(
        [sys.executable, "-m", "fedloom", "run", str(path), "--out", str(tmp_path / "r"),
         "--set", "algorithm.max_depth=2"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "global accuracy" in ok.stdout
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert saved["algorithm"]["max_depth"] == 2
    bad = subprocess.run(
        [sys.executable, "-m", "fedloom", "run", str(path), "--set", "algorithm.n_tree=3"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert bad.returncode == 2
    assert "algorithm.n_tree" in bad.stderr and "n_trees" in bad.stderr


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"algorithm": {"name": "secureboot"}}, "Did you mean 'secureboost'"),
        ({"secure_aggregation": {"kind": "secret_sharing"}}, "FTL's protocol"),
        ({"data": {"name": "breast_cancer", "partition": {"kind": "vertical",
                                                          "parties": [[0, 10], [5, 30]]}}},
         "overlap"),
        ({"data": {"name": "breast_cancer", "partition": {"kind": "vertical",
                                                          "parties": [[0, 10], [10, 31]]}}},
         "end <= 30"),
        ({"secure_aggregation": {"kind": "paillier", "key_bits": 1000}}, "multiple of 256"),
        ({"algorithm": {"name": "vertical_logistic"}, "data": {"name": "diabetes", "partition": {
            "kind": "vertical", "parties": [[0, 5], [5, 10]]}}}, "binary labels"),
        ({"algorithm": {"name": "vertical_logistic", "protocol": "two_party"}, "data": {
            "name": "breast_cancer", "partition": {"kind": "vertical",
                                                   "parties": [[0, 10], [10, 20], [20, 30]]}}},
         "protocol three_party"),
        ({"algorithm": {"name": "vertical_linear"}, "data": {"name": "wine", "partition": {
            "kind": "vertical", "parties": [[0, 5], [5, 13]]}}}, "use algorithm secureboost"),
        ({"algorithm": {"name": "vertical_logistic"}, "data": {
            "name": "breast_cancer", "missing_fraction": 0.1,
            "partition": {"kind": "vertical", "parties": [[0, 10], [10, 30]]}}},
         "missing_fraction applies to secureboost only"),
        ({"algorithm": {"name": "secureboost", "objective": "binary:logistic", "num_class": 3}},
         "num_class applies to objective multi:softprob"),
        ({"algorithm": {"name": "secureboost", "num_clas": 3}}, "num_class"),
    ],
)  # fmt: skip
def test_config_errors_name_the_key(change, message):
    cfg = {**CONFIGS["secureboost"], **change}
    with pytest.raises(ConfigError, match=message):
        fedloom.run(cfg, write=False)


def test_vertical_data_split():
    """The issue's split: stratified for classification, scaler fit on the training rows,
    blocks in the configured column ranges (party 0 first)."""
    data = load_vertical("breast_cancer", [[20, 30], [0, 20]], 0.3, 5)
    x, y = load_breast_cancer(return_X_y=True)
    x_tr, x_te, _, y_te = train_test_split(x, y, test_size=0.3, random_state=5, stratify=y)
    sc = StandardScaler().fit(x_tr)
    np.testing.assert_allclose(data.train_parts[0], sc.transform(x_tr)[:, 20:])
    np.testing.assert_allclose(data.test_parts[1], sc.transform(x_te)[:, :20])
    np.testing.assert_array_equal(data.y_test, y_te)
    assert data.task == "binary" and data.y_scale is None


def test_yaml_multiclass_with_missing_values_and_two_hosts(tmp_path):
    """wine (3 classes), a guest and two hosts, 10% of the entries missing: a YAML run whose
    test metrics equal SecureBoost's Python API on the same data."""
    parties = [[0, 5], [5, 9], [9, 13]]
    cfg = {
        "data": {"name": "wine", "missing_fraction": 0.1,
                 "partition": {"kind": "vertical", "parties": parties}},
        "algorithm": {"name": "secureboost", "n_trees": 5, "max_depth": 3, "base_score": 0.5},
        "eval": {"every": 5},
    }  # fmt: skip
    result = fedloom.run(_yaml(tmp_path, cfg), out=tmp_path / "run")
    data = load_vertical("wine", parties, 0.3, 0, missing_fraction=0.1)
    assert np.isnan(data.train_parts[1]).any() and np.isnan(data.test_parts[2]).any()
    model = SecureBoost(5, 3, base_score=0.5, objective="multi:softprob", num_class=3)
    model.fit(data.train_parts, data.y_train)
    proba = model.predict_proba(data.test_parts)
    final = result.summary["final"]["global"]
    assert final["accuracy"] == pytest.approx(np.mean(proba.argmax(1) == data.y_test))
    assert final["accuracy"] >= 0.85 and set(final) == {"accuracy", "auc", "loss"}
    vert = result.summary["vertical"]
    assert vert["task"] == "multiclass" and len(vert["leaves_per_tree"]) == 15
    assert [r["round"] for r in result.history] == [5]
    assert 'id="vertical_progress"' in (tmp_path / "run" / "report.html").read_text()
