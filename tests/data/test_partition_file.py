"""Frozen partitions: every pooled run writes partition.json; ``kind: file`` reads it back and
gives the same clients, bit for bit; a damaged or foreign file is exit 2 naming the problem."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

import fedloom
from fedloom.cli import app
from fedloom.data import load_dataset
from fedloom.data.digits import load_digits_arrays
from fedloom.data.partition_file import pool_checksum
from fedloom.errors import ConfigError, DataError

CONFIG = {
    "seed": 3,
    "data": {"name": "digits", "num_clients": 6, "partition": {"kind": "noise", "sigma": 0.2}},
    "model": {"name": "logreg"},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 2, "clients_per_round": 3, "local_steps": 2},
    "eval": {"every": 1},
}


@pytest.fixture(scope="module")
def original(tmp_path_factory) -> tuple[Path, fedloom.RunResult]:
    out = tmp_path_factory.mktemp("frozen") / "original"
    return out, fedloom.run(CONFIG, out=out, progress=False)


def _from_file(path: Path | str) -> dict:
    cfg = copy.deepcopy(CONFIG)
    cfg["data"]["partition"] = {"kind": "file", "path": str(path)}
    return cfg


def test_partition_json_records_the_split(original) -> None:
    out, _ = original
    rec = json.loads((out / "partition.json").read_text())
    x, y = load_digits_arrays()
    assert rec["format"] == "fedloom-partition/1"
    assert rec["dataset"] == "digits" and rec["num_clients"] == 6 and rec["num_samples"] == 1797
    assert rec["sha256"] == pool_checksum(x, y)
    assert rec["partition"] == {"kind": "noise", "sigma": 0.2} and rec["seed"] == 3
    data = load_dataset(fedloom.config.parse_config(CONFIG).data, seed=3)
    for c, (train, test) in zip(rec["clients"], data.extras["client_indices"], strict=True):
        assert c["train"] == train.tolist() and c["test"] == test.tolist()
    flat = np.concatenate([c["train"] + c["test"] for c in rec["clients"]])
    assert np.array_equal(np.sort(flat), np.arange(1797))


def _untimed(obj):
    """``obj`` without its wall-clock entries (the only thing two equal runs differ in)."""
    if isinstance(obj, dict):
        return {k: _untimed(v) for k, v in obj.items() if "seconds" not in k}
    if isinstance(obj, list):
        return [_untimed(v) for v in obj]
    return obj


def test_a_run_from_the_file_equals_the_original_bit_for_bit(original, tmp_path) -> None:
    out, first = original
    again = fedloom.run(_from_file(out / "partition.json"), out=tmp_path / "again", progress=False)
    assert _untimed(again.history) == _untimed(first.history)
    assert again.summary["final"] == first.summary["final"]
    for name, value in first.global_params.items():
        assert torch.equal(again.global_params[name], value), name
    rec_a = json.loads((out / "partition.json").read_text())
    rec_b = json.loads((tmp_path / "again" / "partition.json").read_text())
    assert rec_b.pop("read_from") == str(out / "partition.json")
    assert rec_a == rec_b  # the file a file-run writes is the same file again


def test_the_file_fixes_the_data_whatever_the_seed(original) -> None:
    # the clients, their order and the noise come from the file (its partition and seed)
    out, _ = original
    frozen = load_dataset(fedloom.config.parse_config(_from_file(out / "partition.json")).data, 9)
    data = load_dataset(fedloom.config.parse_config(CONFIG).data, seed=3)
    assert frozen.extras["partition"] == {"kind": "noise", "sigma": 0.2}
    for a, b in zip(frozen.clients, data.clients, strict=True):
        for t in ("x_train", "y_train", "x_test", "y_test"):
            assert torch.equal(getattr(a, t), getattr(b, t))


def _write(tmp_path: Path, rec: dict | str) -> Path:
    path = tmp_path / "bad.json"
    path.write_text(rec if isinstance(rec, str) else json.dumps(rec))
    return path


def _load(path: Path, num_clients: int = 6, name: str = "digits"):
    cfg = _from_file(path)
    cfg["data"]["num_clients"] = num_clients
    cfg["data"]["name"] = name
    return load_dataset(fedloom.config.parse_config(cfg).data, seed=0)


def _edit(rec: dict, how: str) -> dict:
    rec = copy.deepcopy(rec)
    c0, c1 = rec["clients"][0], rec["clients"][1]
    if how == "type":
        rec["num_clients"] = "6"
    elif how == "range":
        c0["train"][0] = 1797
    elif how == "negative":
        c0["test"][0] = -1
    elif how == "float":
        c0["train"][0] = 3.0
    elif how == "duplicate":
        c0["train"].append(c0["train"][0])
    elif how == "train_test_overlap":
        c0["test"].append(c0["train"][0])
    elif how == "clients_overlap":
        c1["train"].append(c0["train"][0])
    elif how == "missing_key":
        del c0["test"]
    elif how == "too_few_clients":
        rec["clients"].pop()
    elif how == "partition":
        rec["partition"] = {"kind": "noise", "sigma": -1}
    elif how == "format":
        rec["format"] = "pfllib"
    elif how == "checksum":
        rec["sha256"] = "0" * 64
    elif how == "dataset":
        rec["dataset"] = "mnist"
    return rec


@pytest.mark.parametrize(
    ("how", "error", "words"),
    [
        ("type", DataError, "'num_clients' must be an integer"),
        ("range", DataError, "index 1797, outside the pool's 0..1796"),
        ("negative", DataError, "index -1, outside"),
        ("float", DataError, "clients[0].train must be a list of integers"),
        ("duplicate", DataError, "appears more than once"),
        ("train_test_overlap", DataError, "appears more than once"),
        ("clients_overlap", DataError, "appears more than once"),
        ("missing_key", DataError, "clients[0] must be a mapping with 'train' and 'test'"),
        ("too_few_clients", DataError, "'clients' must list the 6 clients"),
        ("partition", DataError, "partition.sigma: must be >= 0"),
        ("format", DataError, "not a partition file"),
        ("checksum", DataError, "made from another digits pool"),
        ("dataset", DataError, "a partition of dataset 'mnist', not 'digits'"),
    ],
)
def test_damaged_or_foreign_files_are_refused(original, tmp_path, how, error, words) -> None:
    out, _ = original
    rec = json.loads((out / "partition.json").read_text())
    path = _write(tmp_path, _edit(rec, how))
    with pytest.raises(error) as err:
        _load(path)
    assert str(path) in str(err.value) and words in str(err.value)


def test_bad_json_missing_file_and_other_client_count(original, tmp_path) -> None:
    out, _ = original
    with pytest.raises(DataError, match="not valid JSON"):
        _load(_write(tmp_path, '{"format": "fedloom-partition/1", "clients": [}'))
    with pytest.raises(ConfigError, match=r"data\.partition\.path: no partition file"):
        _load(tmp_path / "nowhere.json")
    with pytest.raises(ConfigError, match=r"data\.num_clients: .* holds 6 clients, got 5; set"):
        _load(out / "partition.json", num_clients=5)


def test_datasets_without_a_pool_refuse_file(original) -> None:
    out, _ = original
    with pytest.raises(ConfigError, match="does not support partition 'file'"):
        _load(out / "partition.json", name="synthetic")


def test_cli_exits_2_on_a_damaged_file(original, tmp_path) -> None:
    out, _ = original
    rec = json.loads((out / "partition.json").read_text())
    bad = _write(tmp_path, _edit(rec, "clients_overlap"))
    cfg = tmp_path / "config.yaml"
    cfg.write_text(yaml.safe_dump(_from_file(bad)))
    result = CliRunner().invoke(app, ["run", str(cfg), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    assert "appears more than once" in result.stderr and "Traceback" not in result.output


def test_a_file_keeps_its_order_and_may_leave_samples_out(original, tmp_path) -> None:
    out, _ = original
    rec = json.loads((out / "partition.json").read_text())
    rec["partition"] = {"kind": "iid"}  # no feature shift: the samples are the pool's
    rec["clients"][0]["train"] = rec["clients"][0]["train"][::-1]
    dropped = rec["clients"][1]["test"].pop()
    data = _load(_write(tmp_path, rec))
    x, y = load_digits_arrays()
    order = rec["clients"][0]["train"]
    assert torch.equal(data.clients[0].y_train, torch.from_numpy(y[order]))
    assert torch.allclose(data.clients[0].x_train[:, 0], torch.from_numpy(x[order] / 16).float())
    assert data.clients[1].num_test == len(rec["clients"][1]["test"])
    used = np.concatenate([a for pair in data.extras["client_indices"] for a in pair])
    assert dropped not in used and len(used) == 1796
