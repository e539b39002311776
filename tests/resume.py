"""The kill-and-resume check every stateful algorithm's tests share: a run killed (an upload
transform raises) after a checkpoint and resumed from it equals the uninterrupted run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import fedloom
from fedloom.config import parse_config
from fedloom.data import FederatedData, load_dataset
from fedloom.engine.loop import Engine
from fedloom.engine.rundir import RunDir
from fedloom.models import build_model
from tests.conftest import metrics_without_time


class Crash(RuntimeError):
    pass


def crash_at(round_: int):
    """An upload transform that kills the run in round ``round_``."""

    def transform(upload, client_id, round):
        if round == round_:
            raise Crash(f"killed in round {round}")
        return upload

    return transform


def killed_and_resumed(
    config: dict[str, Any],
    tmp_path: Path,
    crash_round: int,
    data: FederatedData | None = None,
) -> tuple[fedloom.RunResult, fedloom.RunResult, dict[str, Any]]:
    """(uninterrupted run, run killed in ``crash_round`` and resumed, the checkpoint it resumed
    from), after asserting that the two runs give identical metrics, global model and client
    models; ``data``: the runs' dataset instead of the configured one (the Python API's)."""
    full = fedloom.run(config, data=data, out=tmp_path / "full", progress=False)
    cfg = parse_config(config)
    custom = data
    if data is None:
        data = load_dataset(cfg.data, cfg.seed)
    run_dir = RunDir.create(tmp_path / "killed")
    run_dir.write_config(cfg.to_yaml())
    module = build_model(cfg.model.name, data.input_shape, data.num_outputs)
    engine = Engine(cfg, data, module, run_dir=run_dir, upload_transforms=[crash_at(crash_round)])
    with pytest.raises(Crash):
        engine.run()
    killed_at = run_dir.latest_checkpoint()
    resumed = fedloom.run(resume=tmp_path / "killed", data=custom, progress=False)
    assert metrics_without_time(resumed.history) == metrics_without_time(full.history)
    rows = [json.loads(x) for x in (run_dir.path / "metrics.jsonl").read_text().splitlines()]
    assert metrics_without_time(rows) == metrics_without_time(full.history)
    assert (full.global_params is None) == (resumed.global_params is None)
    for key, value in (full.global_params or {}).items():
        assert torch.equal(value, resumed.global_params[key]), key
    assert full.client_params.keys() == resumed.client_params.keys()
    for cid, params in full.client_params.items():
        for key in params:
            assert torch.equal(params[key], resumed.client_params[cid][key]), (cid, key)
    assert killed_at is not None
    return full, resumed, killed_at
