"""A run directory is a trust boundary (core/runpaths.py; README.md, "Run directory"): paths
are named inside it, pruning deletes only fedloom's own file names, an export is whole or
absent, and the messages of a resume that cannot go on say how to proceed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

import fedloom.serving.export as export_module
from fedloom.core.runpaths import find_link, under, write_text_atomic
from fedloom.engine.rundir import RunDir, RunLock
from fedloom.errors import RunDirError
from tests.cli.invoke import QUADRATIC, fedloom, write_yaml


# -- naming paths ----------------------------------------------------------------------------
def test_under_refuses_links_and_names_leaving_the_run(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    assert under(run, "checkpoints", "round_000001.json") == run / "checkpoints/round_000001.json"
    assert under(run, "not-yet", "there.json") == run / "not-yet/there.json"  # absent: fine
    (run / "serving").symlink_to(outside)
    with pytest.raises(RunDirError, match=r"run/serving is a symbolic link \(to .*outside\)"):
        under(run, "serving", "global.safetensors")
    (run / "checkpoints" / "round_000002.json").symlink_to(run / "config.yaml")  # even inside
    with pytest.raises(RunDirError, match=r"round_000002\.json is a symbolic link"):
        under(run, "checkpoints/round_000002.json")
    for name in ("../outside/x", "/etc/passwd", "a/../../x"):
        with pytest.raises(RunDirError, match="points outside"):
            under(run, name)
    with pytest.raises(RunDirError, match="not a file name"):
        under(run, 3)  # type: ignore[arg-type]  # a number where serving.json has a name
    # a folder's own entries first, then its subfolders'; a link to a folder is not entered
    assert find_link(run) == run / "serving"
    (run / "serving").unlink()
    assert find_link(run) == run / "checkpoints" / "round_000002.json"
    (run / "checkpoints" / "round_000002.json").unlink()
    assert find_link(run) is None


def test_an_atomic_write_removes_a_planted_temporary_link(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's")
    run = tmp_path / "run"
    run.mkdir()
    (run / f".summary.json.{os.getpid()}.tmp").symlink_to(victim)
    write_text_atomic(run / "summary.json", "{}")
    assert victim.read_text() == "the user's"
    assert (run / "summary.json").read_text() == "{}"
    assert sorted(p.name for p in run.iterdir()) == ["summary.json"]


def test_a_lock_file_that_is_a_link_is_refused_and_its_target_kept(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's")
    run = tmp_path / "run"
    run.mkdir()
    (run / ".lock").symlink_to(victim)
    with pytest.raises(RunDirError, match=r"\.lock is a symbolic link"):
        RunLock.acquire(run)
    assert victim.read_text() == "the user's"  # not truncated to a PID


# -- pruning ---------------------------------------------------------------------------------
def test_pruning_deletes_only_the_checkpoint_files_fedloom_writes(tmp_path):
    run = RunDir.create(tmp_path / "run")
    theirs = ["round_7.notes", "round_000001.bak", "round_000001.json~", "round_000009.txt"]
    for name in theirs:
        (run.checkpoint_dir / name).write_text("the user's")
    (run.checkpoint_dir / "round_000005.safetensors.tmp").write_text("a crash's leftover")
    for r in (1, 2, 3):
        run.save_checkpoint(r, {"round": r, "w": torch.ones(2) * r}, keep=2)
    names = sorted(p.name for p in run.checkpoint_dir.iterdir())
    ours = [f"round_00000{r}.{s}" for r in (2, 3) for s in ("json", "safetensors")]
    # round 1 pruned; round 5's leftover was after the newest round: stale, removed
    assert names == sorted(theirs + ours)
    assert run.latest_checkpoint()["round"] == 3


# -- export ------------------------------------------------------------------------------------
CONFIG = {**QUADRATIC, "serving": {"ema": 0.9}}


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("trust")
    out = fedloom(["run", str(write_yaml(root / "c.yaml", CONFIG)), "--out", str(root / "run")])
    assert out.code == 0, out.stderr
    return root / "run"


def test_a_failed_export_leaves_nothing_behind(finished, tmp_path, monkeypatch):
    saved = []

    def save_then_fail(tensors, path, copy, model):
        if saved:
            raise OSError(28, "No space left on device")
        saved.append(path)
        real_save(tensors, path, copy, model)

    real_save = export_module._save
    monkeypatch.setattr(export_module, "_save", save_then_fail)
    out = fedloom(["export", str(finished), "--out", str(tmp_path / "exp")])
    assert out.is_clear_input_error() and saved, out.stderr
    assert "cannot write export directory" in out.stderr and "No space left" in out.stderr
    assert sorted(os.listdir(tmp_path)) == []  # neither exp/ nor its staging folder
    monkeypatch.undo()
    (tmp_path / "exp").mkdir()  # an empty folder is filled
    out = fedloom(["export", str(finished), "--out", str(tmp_path / "exp")])
    assert out.code == 0, out.stderr
    assert sorted(os.listdir(tmp_path)) == ["exp"]
    assert sorted(os.listdir(tmp_path / "exp")) == [
        "card.json",
        "ema.safetensors",
        "global.safetensors",
    ]
    assert (tmp_path / "exp").stat().st_mode & 0o755 == 0o755


def test_an_export_folder_that_is_a_file_is_named_so(finished, tmp_path):
    (tmp_path / "exp").write_text("")
    out = fedloom(["export", str(finished), "--out", str(tmp_path / "exp")])
    assert out.is_clear_input_error(), out.stderr
    assert "is a file" in out.stderr


# -- messages that lead somewhere --------------------------------------------------------------
def test_a_run_stopped_before_its_first_checkpoint_says_how_to_start_again(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    shutil.rmtree(run / "checkpoints")
    (run / "checkpoints").mkdir()
    out = fedloom(["run", "--resume", str(run)])
    assert out.is_clear_input_error(), out.stderr
    text = " ".join(out.stderr.split())
    assert "has no checkpoint to resume from: it stopped before its first checkpoint" in text
    assert f"fedloom run {run / 'config.yaml'} --out NEW_DIR" in text
    again = fedloom(["run", str(run / "config.yaml"), "--out", str(tmp_path / "new")])
    assert again.code == 0, again.stderr  # the way out it names works


def test_resume_with_set_lists_only_the_keys_set(finished, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(finished, run)
    out = fedloom(["run", "--resume", str(run), "--set", "train.lr=0.9"])
    assert out.is_clear_input_error(), out.stderr
    assert "differs from the given config at train.lr;" in " ".join(out.stderr.split())
    same = fedloom(["run", "--resume", str(run), "--set", f"train.lr={CONFIG['train']['lr']}"])
    assert same.code == 0, same.stderr  # the run's own value: nothing differs


def test_a_directory_as_the_config_and_a_file_as_out_are_named(tmp_path):
    out = fedloom(["run", str(tmp_path)])
    assert out.is_clear_input_error(), out.stderr
    assert "is a directory: give the YAML file itself" in out.stderr
    config = write_yaml(tmp_path / "c.yaml", QUADRATIC)
    out = fedloom(["run", str(config), "--out", str(config)])
    assert out.is_clear_input_error(), out.stderr
    assert "is a file; a run writes a folder" in out.stderr


def test_no_file_of_a_run_directory_is_executable(finished):
    """Files are written 0o644 (before the umask): os.open without a mode would make the
    metrics log an executable 0o755 file."""
    executable = [
        str(p.relative_to(finished))
        for p in finished.rglob("*")
        if p.is_file() and p.stat().st_mode & 0o111
    ]
    assert executable == []
