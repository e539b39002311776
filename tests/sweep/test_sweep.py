"""Sweeps for real: each run in its own worker process, a failed cell recorded without stopping
the others, finished runs never run again, and a sweep killed with SIGKILL finishing on rerun
with exactly the results of an uninterrupted one."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.sweep import sweep
from tests.conftest import metrics_without_time
from tests.sweep.specs import BASE, write_spec

QUADRATIC = {
    "data": {"name": "quadratic", "num_clients": 3, "quadratic": {"dim": 3, "samples": 20}},
    "model": {"name": "logreg"},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 1, "local_steps": 2, "batch_size": None, "lr": 0.05},
}
ACCURACY_COLUMNS = (
    "final_global_accuracy_fraction",
    "final_personalized_mean_fraction",
    "final_personalized_p10_fraction",
    "final_personalized_p50_fraction",
    "final_personalized_p90_fraction",
    "best_personalized_mean_fraction",
    "rounds",
    "mb_up",
    "mb_down",
)


def read_rows(out: Path) -> list[dict[str, str]]:
    with (out / "results.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def test_a_failed_cell_is_recorded_and_finished_runs_are_not_rerun(tmp_path):
    """The cnn cell fails inside its worker (a quadratic's vectors are no images: exit 2
    there), the logreg cell finishes; a second call reruns only the failed one."""
    spec = write_spec(tmp_path, base=QUADRATIC, grid={"model.name": ["logreg", "cnn"]})
    out = tmp_path / "out"
    result = sweep(spec, out, jobs=2, progress=False, compare=False)
    rows = read_rows(out)
    assert [(r["model.name"], r["seed"], r["status"]) for r in rows] == [
        ("logreg", "0", "finished"),
        ("cnn", "0", "failed"),
    ]
    assert rows[1]["error"].startswith("ConfigError: model.name: cnn does not fit this data")
    assert [r["status"] for r in result.failed] == ["failed"] and result.ran == 2
    run_dir = out / rows[0]["run_dir"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert rows[0]["rounds"] == "1" and rows[0]["final_global_accuracy_fraction"] == ""
    assert float(rows[0]["mb_up"]) == summary["communication"]["bytes_up"] / 1e6
    assert float(rows[0]["seconds_per_round"]) == summary["seconds_per_round"]
    assert "| logreg | – |" in (out / "table.md").read_text()  # a regression: no accuracy
    cells = json.loads((out / "cells.json").read_text())
    assert cells[1] == {
        "name": "model.name=cnn",
        "values": {"model.name": "cnn"},
        "runs": {"0": "runs/model.name=cnn/seed_0"},
    }
    mtime = (run_dir / "summary.json").stat().st_mtime_ns
    # again, from the command line: exit 1 naming the failed run
    args = ["sweep", str(spec), "--out", str(out), "--jobs", "2", "--no-progress", "--no-compare"]
    again = CliRunner().invoke(app, args)
    assert again.exit_code == 1, again.output
    assert "failed: runs/model.name=cnn/seed_0: ConfigError: model.name: cnn" in again.output
    assert "1 of 2 runs finished; this call ran 1" in again.stdout
    assert (run_dir / "summary.json").stat().st_mtime_ns == mtime
    assert read_rows(out) == rows
    log = (out / "logs" / "model.name=cnn" / "seed_0.log").read_text()
    assert log.count("fresh") == 2  # tried twice, never resumed (no checkpoint)


def _cli(spec: Path, out: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "fedloom",
        "sweep",
        str(spec),
        "--out",
        str(out),
        "--jobs",
        "1",
        "--no-progress",
    ]


def _checkpoints(run_dir: Path) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").glob("round_*"))


@pytest.mark.heavy(budget=300)
def test_a_killed_sweep_finishes_on_rerun_as_if_never_killed(tmp_path):
    """SIGKILL the sweep once the first cell finished and the second is mid-run, checkpointed:
    the rerun leaves the first alone and resumes the second, and every number equals an
    uninterrupted sweep's. The killed sweep's worker dies with it (no run goes on)."""
    base = {**BASE, "train": {**BASE["train"], "rounds": 60}}
    spec = write_spec(tmp_path, base=base, grid={"algorithm.name": ["fedavg", "ditto"]})
    out = tmp_path / "killed"
    first, second = (
        out / "runs/algorithm.name=fedavg/seed_0",
        out / "runs/algorithm.name=ditto/seed_0",
    )
    proc = subprocess.Popen(_cli(spec, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 200
    while not (
        (first / "summary.json").is_file()
        and second.is_dir()
        and any(p.name.endswith(".json") for p in (second / "checkpoints").glob("round_*"))
    ):
        assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
        assert time.monotonic() < deadline
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (second / "summary.json").is_file(), "the second cell finished before the kill"
    time.sleep(1.0)
    left = _checkpoints(second)
    time.sleep(2.0)
    assert _checkpoints(second) == left  # its worker died with the sweep
    finished_at = (first / "summary.json").stat().st_mtime_ns
    rerun = subprocess.run(_cli(spec, out), capture_output=True, text=True, check=False)
    assert rerun.returncode == 0, rerun.stderr
    assert "2 of 2 runs finished; this call ran 1" in rerun.stdout
    assert (first / "summary.json").stat().st_mtime_ns == finished_at
    assert "resume" in (out / "logs/algorithm.name=ditto/seed_0.log").read_text()
    whole = tmp_path / "whole"
    assert subprocess.run(_cli(spec, whole), capture_output=True, check=False).returncode == 0
    killed_rows, whole_rows = read_rows(out), read_rows(whole)
    for a, b in zip(killed_rows, whole_rows, strict=True):
        assert {k: a[k] for k in ACCURACY_COLUMNS} == {k: b[k] for k in ACCURACY_COLUMNS}
        assert a["status"] == b["status"] == "finished"
    for rel in ("runs/algorithm.name=fedavg/seed_0", "runs/algorithm.name=ditto/seed_0"):
        history = [
            json.loads(line) for line in (out / rel / "metrics.jsonl").read_text().splitlines()
        ]
        reference = [
            json.loads(line) for line in (whole / rel / "metrics.jsonl").read_text().splitlines()
        ]
        assert metrics_without_time(history) == metrics_without_time(reference)
    assert (out / "compare.html").is_file() and (out / "table.tex").is_file()
