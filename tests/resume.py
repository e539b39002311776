"""The kill-and-resume check every stateful algorithm's tests share: a run killed (a callback
raises, the one way to extend a run: engine/context.py) after a checkpoint and resumed from it
equals the uninterrupted run; and the kill of an RL or vertical run, after the run shell has
ended a round (engine/shell.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch

import fedloom
from fedloom.data import FederatedData
from fedloom.engine.context import Callback
from fedloom.engine.rundir import RunDir
from fedloom.engine.shell import RunShell
from tests.conftest import metrics_without_time


class Crash(RuntimeError):
    pass


class CrashAt(Callback):
    """A callback that kills the run in round ``round``, before its metrics row and
    checkpoint are written."""

    def __init__(self, round: int) -> None:
        self.round = round

    def on_round_end(self, ctx, state, report) -> dict[str, Any]:
        if report.round == self.round:
            raise Crash(f"killed in round {report.round}")
        return {}


def crash_after(round_: int):
    """A patch of the run shell that kills any run once round ``round_`` has ended (its row
    and any due checkpoint written): RL and vertical runs take no callbacks."""
    end_round = RunShell.end_round

    def ending(self, done, row, payload):
        end_round(self, done, row, payload)
        if done == round_:
            raise Crash(f"killed after round {done}")

    return mock.patch.object(RunShell, "end_round", ending)


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
    with pytest.raises(Crash):
        kill = [CrashAt(crash_round)]
        fedloom.run(config, data=data, out=tmp_path / "killed", progress=False, callbacks=kill)
    run_dir = RunDir.open_existing(tmp_path / "killed")
    killed_at = run_dir.latest_checkpoint()
    resumed = fedloom.run(resume=tmp_path / "killed", data=data, progress=False)
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
