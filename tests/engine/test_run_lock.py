"""One process at a time writes a run directory (engine/rundir.py, ``RunLock``;
docs/architecture.md, "Run directory lock"): a second run of it, new or resumed, horizontal,
RL or vertical, from the Python API or the command line, is refused naming the writer's PID;
readers take no lock; the kernel frees the lock of a killed writer, and forked children do
not keep it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

import fedloom
from fedloom.engine.callbacks import Callback
from fedloom.engine.rundir import LOCK_FILE, RunDir, lock_holder
from fedloom.errors import RunDirError, RunDirLocked
from fedloom.report import write_report
from fedloom.report.rundir import load_run
from tests.cli.invoke import fedloom as fedloom_in_process
from tests.conftest import metrics_without_time

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
"""A child runs this checkout's fedloom (not whatever the interpreter has installed)."""


def quadratic(rounds: int, **executor: Any) -> dict[str, Any]:
    return {
        "seed": 3,
        "data": {"name": "quadratic", "num_clients": 20},
        "model": {"name": "logreg"},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": rounds, "clients_per_round": 10, "local_steps": 5, "lr": 0.02},
        "eval": {"every": 1},
        "checkpoint": {"every": 1, "keep": 2},
        "executor": {"kind": "sequential", **executor},
    }


def test_the_writer_holds_the_lock_and_a_second_writer_is_refused(tmp_path):
    run = RunDir.create(tmp_path / "run")
    assert lock_holder(run.path) == os.getpid()
    assert (run.path / LOCK_FILE).read_text().strip() == str(os.getpid())
    run.write_config("seed: 1\n")
    for second in (RunDir.create, RunDir.open_for_writing):
        with pytest.raises(RunDirLocked, match="being written by this process") as err:
            second(run.path)
        assert err.value.pid == os.getpid()
    assert RunDir.open_existing(run.path).lock is None  # a reader takes none
    run.release()
    assert lock_holder(run.path) is None
    again = RunDir.open_for_writing(run.path)  # free once released: a resume may write
    assert lock_holder(run.path) == os.getpid()
    again.release()
    with pytest.raises(RunDirError, match="not empty") as err:
        RunDir.create(run.path)  # not locked, but another run's directory
    assert not isinstance(err.value, RunDirLocked)


def test_a_reader_creates_no_lock_file(tmp_path):
    fedloom.run(quadratic(2), out=tmp_path / "run", progress=False)
    (tmp_path / "run" / LOCK_FILE).unlink()
    assert lock_holder(tmp_path / "run") is None
    load_run(tmp_path / "run")
    write_report(tmp_path / "run")
    assert not (tmp_path / "run" / LOCK_FILE).exists()


def test_the_python_api_refuses_a_directory_another_run_writes(tmp_path):
    """``fedloom.run(out=...)`` and ``fedloom.run(resume=...)`` of a held directory raise the
    CLI's exit-2 error for every run family; the holder's files are untouched; ``fedloom
    report`` still rebuilds report.html, and the audit waits for the end."""
    fedloom.run(quadratic(2), out=tmp_path / "run", progress=False)
    held = RunDir.open_for_writing(tmp_path / "run")
    files = {p.name: p.read_bytes() for p in held.path.iterdir() if p.is_file()}
    rl = {"kind": "rl", "data": {"name": "cartpole", "num_clients": 2}, "train": {"rounds": 2}}
    vertical = {
        "kind": "vertical",
        "data": {
            "name": "breast_cancer",
            "partition": {"kind": "vertical", "parties": [[0, 15], [15, 30]]},
        },
        "algorithm": {"name": "vertical_logistic", "iterations": 2},
    }
    for config in (quadratic(2), rl, vertical):
        with pytest.raises(RunDirLocked, match="being written by this process"):
            fedloom.run(config, out=held.path, progress=False)
    with pytest.raises(RunDirLocked, match="this process"):
        fedloom.run(resume=held.path, progress=False)
    for family, config in (("rl", rl), ("vertical", vertical)):  # their resume path
        other = tmp_path / family
        other.mkdir()
        (other / "config.yaml").write_text(yaml.safe_dump(config))
        lock = RunDir.open_for_writing(other)
        with pytest.raises(RunDirLocked):
            fedloom.run(resume=other, progress=False)
        lock.release()
    with pytest.raises(RunDirLocked, match="audit it when"):
        fedloom.audit(held.path)
    (held.path / "report.html").unlink()
    write_report(held.path)  # a reader: the report of a run being written
    assert lock_holder(held.path) == os.getpid()
    after = {p.name: p.read_bytes() for p in held.path.iterdir() if p.is_file()}
    assert after.keys() == files.keys()
    assert [k for k in after if after[k] != files[k] and k != "report.html"] == []
    held.release()
    assert fedloom.run(resume=held.path, progress=False).summary["rounds"] == 2


def test_the_command_line_exits_2_naming_the_writer(tmp_path):
    fedloom.run(quadratic(2), out=tmp_path / "run", progress=False)
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(quadratic(2)))
    held = RunDir.open_for_writing(tmp_path / "run")
    for args in (
        ["--resume", str(held.path)],
        [str(tmp_path / "config.yaml"), "--out", str(held.path)],
    ):
        outcome = fedloom_in_process(["run", *args])
        assert outcome.is_clear_input_error(), outcome.stderr
        assert "being written by this process" in outcome.stderr
    held.release()


def test_a_failed_run_frees_its_directory_in_the_same_process(tmp_path):
    """The lock ends with ``fedloom.run``'s call, however it ends: a run that raised is
    resumed at once from the same process."""

    class Crash(RuntimeError):
        pass

    class CrashAt3(Callback):
        def on_round_end(self, ctx, state, report):
            if report.round == 3:
                raise Crash
            return {}

    with pytest.raises(Crash):
        fedloom.run(quadratic(4), out=tmp_path / "run", progress=False, callbacks=[CrashAt3()])
    assert lock_holder(tmp_path / "run") is None
    assert fedloom.run(resume=tmp_path / "run", progress=False).history[-1]["round"] == 4


FORKER = """
import os, sys, time
from fedloom.engine.rundir import RunDir
run = RunDir.create(sys.argv[1])
child = os.fork()
if child == 0:  # a forked worker: sleeps past its parent's death
    time.sleep(30)
    os._exit(0)
print(child, flush=True)
time.sleep(30)
"""


def test_a_forked_child_does_not_keep_the_lock_of_a_killed_parent(tmp_path):
    """flock belongs to the open file, which a child forked without exec shares: the lock's
    descriptor is closed in the child right after the fork, so kill -9 of the writer frees
    the directory while its child lives on."""
    run = tmp_path / "run"
    parent = subprocess.Popen(
        [sys.executable, "-c", FORKER, str(run)], env=ENV, stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        assert lock_holder(run) == parent.pid
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        os.kill(child, 0)  # still alive: it would hold the lock had it kept the descriptor
        assert lock_holder(run) is None
    finally:
        parent.kill()
        os.kill(child, signal.SIGKILL)


SLOW_RUN = """
import json, sys, time
import fedloom
from fedloom.engine.callbacks import Callback

class Slow(Callback):  # a long run, without a long computation
    def on_round_end(self, ctx, state, report):
        time.sleep(0.5)
        return {}

fedloom.run(json.loads(sys.argv[1]), out=sys.argv[2], progress=False, callbacks=[Slow()])
"""


def fedloom_cli(*args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "fedloom", *args],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.heavy(budget=150)
def test_two_processes_on_one_run_directory(tmp_path):
    """A run with forked workers is writing; ``fedloom run --resume`` and ``--out`` of its
    directory exit 2 naming its PID; kill -9 it; the resume finishes, and metrics.jsonl
    holds each round once, in order, equal to an uninterrupted run's (measured: 25 s)."""
    config = quadratic(30, workers=2)
    run = tmp_path / "run"
    first = subprocess.Popen(
        [sys.executable, "-c", SLOW_RUN, json.dumps(config), str(run)],
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 90
        while len(list((run / "checkpoints").glob("round_*.json"))) < 2:
            assert first.poll() is None, first.communicate()[1][-2000:]
            assert time.monotonic() < deadline, "the first run wrote no checkpoints"
            time.sleep(0.2)
        assert lock_holder(run) == first.pid
        (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
        resume = fedloom_cli("run", "--resume", str(run))
        new = fedloom_cli("run", str(tmp_path / "config.yaml"), "--out", str(run))
        for second in (resume, new):
            _, err = second.communicate(timeout=90)
            assert second.returncode == 2, err
            assert f"being written by process {first.pid}" in err
            assert "Traceback" not in err
        assert first.poll() is None, "the first run ended before the others were refused"
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=10)
    finally:
        first.kill()
    killed_at = RunDir.open_existing(run).latest_checkpoint()
    assert killed_at is not None
    resumed = fedloom_cli("run", "--resume", str(run))
    _, err = resumed.communicate(timeout=120)
    assert resumed.returncode == 0, err
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == list(range(1, 31))
    assert 2 <= killed_at["round"] < 30  # killed mid-run, resumed from a checkpoint
    whole = fedloom.run(config, write=False, progress=False)
    assert metrics_without_time(rows) == metrics_without_time(whole.history)
    assert lock_holder(run) is None
