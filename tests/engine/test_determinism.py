"""Same config, same numbers; a run killed after a checkpoint and resumed equals the
uninterrupted run (DESIGN.md 2.3)."""

from __future__ import annotations

import json

import pytest
import torch

import fedloom
from fedloom.config import parse_config
from fedloom.data import load_dataset
from fedloom.engine.loop import Engine
from fedloom.engine.rundir import RunDir
from fedloom.models import build_model
from tests.conftest import metrics_without_time

CONFIG = {
    "seed": 3,
    "data": {"name": "digits", "num_clients": 8, "partition": {"kind": "dirichlet", "alpha": 0.5}},
    "model": {"name": "mlp"},
    "algorithm": {"name": "fedavg_ft", "finetune_steps": 3},
    "train": {
        "rounds": 6,
        "clients_per_round": 4,
        "local_steps": 5,
        "batch_size": 16,
        "lr": 0.05,
        "stragglers": 0.5,
    },
    "eval": {"every": 2},
    "checkpoint": {"every": 2},
    "executor": {"kind": "sequential"},
}


class Crash(RuntimeError):
    pass


def _crash_at(round_: int):
    def transform(upload, client_id, round):
        if round == round_:
            raise Crash(f"killed in round {round}")
        return upload

    return transform


def test_same_config_gives_identical_metrics():
    a = fedloom.run(CONFIG, write=False, progress=False)
    b = fedloom.run(CONFIG, write=False, progress=False)
    assert metrics_without_time(a.history) == metrics_without_time(b.history)
    for key in a.global_params:
        assert torch.equal(a.global_params[key], b.global_params[key])


def test_different_seed_gives_different_metrics():
    a = fedloom.run(CONFIG, write=False, progress=False)
    b = fedloom.run({**CONFIG, "seed": 4}, write=False, progress=False)
    assert metrics_without_time(a.history) != metrics_without_time(b.history)


@pytest.mark.parametrize(
    "algorithm",
    [
        CONFIG["algorithm"],
        {"name": "scaffold"},  # client controls c_i and server control c
        {"name": "feddyn", "mu": 0.1},  # client gradients g_k and server h
        {"name": "fedyogi", "server_lr": 0.05},  # server moments m, v
    ],
    ids=lambda a: a["name"],
)
def test_killed_and_resumed_run_equals_uninterrupted(tmp_path, algorithm):
    config = {**CONFIG, "algorithm": algorithm}
    full = fedloom.run(config, out=tmp_path / "full", progress=False)

    cfg = parse_config(config)
    data = load_dataset(cfg.data, cfg.seed)
    run_dir = RunDir.create(tmp_path / "killed")
    run_dir.write_config(cfg.to_yaml())
    module = build_model(cfg.model.name, data.input_shape, data.num_outputs)
    engine = Engine(cfg, data, module, run_dir=run_dir, upload_transforms=[_crash_at(5)])
    with pytest.raises(Crash):
        engine.run()
    assert [p.name for p in run_dir.checkpoints()][-1] == "round_000004.pt"

    resumed = fedloom.run(resume=tmp_path / "killed", progress=False)
    assert metrics_without_time(resumed.history) == metrics_without_time(full.history)
    rows = [
        json.loads(line)
        for line in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()
    ]
    assert metrics_without_time(rows) == metrics_without_time(full.history)
    for key in full.global_params:
        assert torch.equal(full.global_params[key], resumed.global_params[key])
    for cid, params in full.client_params.items():
        for key in params:
            assert torch.equal(params[key], resumed.client_params[cid][key])
