"""The run directory contract (README.md, "Run directory") and communication accounting."""

from __future__ import annotations

import json

import pytest
import yaml

import fedloom
from fedloom.core import pytree

CONFIG = {
    "data": {"name": "digits", "num_clients": 6},
    "model": {"name": "logreg"},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 4, "clients_per_round": 3, "local_steps": 2},
    "eval": {"every": 2},
    "checkpoint": {"every": 2},
}


def test_run_directory_holds_the_contract_files(tmp_path):
    result = fedloom.run(CONFIG, out=tmp_path / "run", progress=False)
    run = tmp_path / "run"
    assert {p.name for p in run.iterdir()} >= {
        "config.yaml",
        "metrics.jsonl",
        "summary.json",
        "report.html",
        "checkpoints",
        "label_histogram.json",
    }
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["train"]["lr"] == 0.05 and resolved["algorithm"] == {"name": "fedavg"}
    summary = json.loads((run / "summary.json").read_text())
    assert summary == json.loads(json.dumps(result.summary))
    for key in (
        "algorithm",
        "dataset",
        "num_clients",
        "rounds",
        "seed",
        "executor",
        "final",
        "communication",
        "wall_seconds",
        "seconds_per_round",
    ):
        assert key in summary
    assert set(summary["final"]["personalized"]) >= {
        "accuracy_mean",
        "accuracy_p10",
        "accuracy_p50",
        "accuracy_p90",
        "accuracy_min",
    }
    pers = summary["final"]["personalized"]
    per_client = summary["final"]["client_accuracy"]  # every client's deployed model
    assert sorted(per_client, key=int) == [str(c) for c in range(CONFIG["data"]["num_clients"])]
    assert min(per_client.values()) == pytest.approx(pers["accuracy_min"])
    assert (
        0
        <= pers["accuracy_min"]
        <= pers["accuracy_p10"]
        <= pers["accuracy_p50"]
        <= pers["accuracy_p90"]
        <= 1
    )
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [2, 4]
    hist = json.loads((run / "label_histogram.json").read_text())
    assert len(hist["counts"]) == 6 and sum(map(sum, hist["counts"])) > 1000


def test_bytes_are_counted_from_the_messages(tmp_path):
    result = fedloom.run(CONFIG, write=False, progress=False)
    model_bytes = pytree.num_bytes(result.global_params)
    # 4 rounds x 3 clients, one model down and one model up each
    assert result.summary["communication"] == {
        "bytes_up": 12 * model_bytes,
        "bytes_down": 12 * model_bytes,
        "bytes_up_per_round": 3 * model_bytes,
        "bytes_down_per_round": 3 * model_bytes,
    }


def test_partial_participation_samples_clients_per_round():
    result = fedloom.run({**CONFIG, "algorithm": {"name": "fedsgd"}}, write=False, progress=False)
    assert all(r["participants"] == 3 for r in result.history)
