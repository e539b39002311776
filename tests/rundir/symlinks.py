"""Symbolic links planted in a finished run directory (tests/rundir/test_symlink_fuzz.py): a
run directory someone sent you may hold links to anywhere on your disk, and no fedloom command
may read or write through them (README.md, "Run directory").

A case is one link, at one place of a copy of a finished run (a subfolder, a file in one, a
top-level file, a file fedloom would create), pointing into a *sentinel* tree outside the run
that holds copies of the run's own files (so that a command following the link would find what
it expects and carry on) and decoy files a checkpoint pruning would match by name. The case
runs one command through the CLI in this process; what is checked: its exit status (0 or 2,
never 1), that the sentinel tree is unchanged (names, bytes, modification times), and a time
limit per case."""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fedloom.dashboard.runs import RunsFolder
from tests.cli.invoke import Outcome, fedloom, write_yaml

CONFIG = {
    "seed": 0,
    "data": {"name": "digits", "num_clients": 4},
    "model": {"name": "logreg"},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 2, "local_steps": 1},
    "eval": {"every": 1, "validation_fraction": 0.1},
    "checkpoint": {"every": 1, "keep": 2},
    "serving": {"keep_best": True, "ema": 0.9},
}
"""A run of a few seconds that leaves every kind of file: checkpoints, serving copies, the
report, the label histogram."""

PLANTED = (
    "export",
    "audit.json",
    "audit.html",
    ".lock",
    "summary.json.tmp",
    "checkpoints/round_000002.safetensors.tmp",
    "checkpoints/round_000002.json.tmp",
    "serving/ema.safetensors",
)
"""Places fedloom writes that a finished run may not hold yet (a link there is a trap for the
next write)."""

DECOYS = ("round_000000.json", "round_000000.safetensors", "round_7.notes")
"""Files of the user's in the sentinel's checkpoints/ that a pruning matching by name would
delete."""


def finished_run(folder: Path) -> Path:
    """A finished run directory under ``folder`` (``runs/base``)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = write_yaml(folder / "config.yaml", CONFIG)
    run = folder / "runs" / "base"
    out = fedloom(["run", str(config), "--out", str(run)])
    assert out.code == 0, out.stderr
    return run


def locations(run: Path) -> list[str]:
    """Every entry of the run directory (folders and files, every level) and the planted
    places, as relative paths."""
    found = sorted(str(p.relative_to(run)) for p in run.rglob("*"))
    return found + [p for p in PLANTED if p not in found]


def make_sentinel(run: Path, sentinel: Path) -> None:
    """Copies of the run's files and folders, the decoys, and an empty export/."""
    shutil.copytree(run, sentinel / "copy", symlinks=True)
    (sentinel / "copy" / "export").mkdir()
    for name in DECOYS:
        (sentinel / "copy" / "checkpoints" / name).write_text("the user's file\n")


def tree_digest(root: Path) -> str:
    """SHA-256 of every entry under ``root``: its name, kind, bytes or link target, and its
    modification time (a rewrite with the same bytes changes it too)."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*")):
        st = path.lstat()
        h.update(f"{path.relative_to(root)}|{st.st_mode}|{st.st_mtime_ns}|".encode())
        if path.is_symlink():
            h.update(os.readlink(path).encode())
        elif path.is_file():
            h.update(path.read_bytes())
    return h.hexdigest()


@dataclass
class Case:
    location: str
    target: str  # "copy": the sentinel's copy of that entry; "absent": a name not there yet
    command: str

    @property
    def id(self) -> str:
        return f"{self.command}:{self.location}:{self.target}"


def plant(run: Path, sentinel: Path, location: str, target: str) -> Path:
    """Replace (or create) ``run/location`` by a link into the sentinel tree."""
    link = run / location
    pointee = sentinel / ("copy" if target == "copy" else "absent") / location
    if link.is_dir() and not link.is_symlink():
        shutil.rmtree(link)
    elif link.exists() or link.is_symlink():
        link.unlink()
    link.parent.mkdir(parents=True, exist_ok=True)
    link.symlink_to(pointee, target_is_directory=pointee.is_dir())
    return link


def unfinish(run: Path) -> None:
    """Make ``run`` a run stopped after round 1 (round 2's checkpoint and summary gone), so a
    resume trains, checkpoints and prunes."""
    for path in run.glob("checkpoints/round_000002.*"):
        if not path.is_symlink():
            path.unlink()
    summary = run / "summary.json"
    if summary.is_file() and not summary.is_symlink():
        summary.unlink()


def _dashboard(run: Path) -> Outcome:
    """The dashboard's run listing: a run holding a link is not listed (exit 2 in the tally),
    a listed one is loaded as the run page would."""
    folder = RunsFolder(run.parent)
    if run.name not in folder.names():
        return Outcome(2, "", "not listed")
    entries = [e for e in folder.entries() if e.name == run.name]
    return Outcome(0, "", entries[0].error or "")


COMMANDS: dict[str, Callable[[Path, Path], Outcome]] = {
    "resume": lambda run, tmp: fedloom(["run", "--resume", str(run)]),
    "export": lambda run, tmp: fedloom(["export", str(run)]),
    "report": lambda run, tmp: fedloom(["report", str(run)]),
    "compare": lambda run, tmp: fedloom(["compare", str(run), "--out", str(tmp / "cmp.html")]),
    "audit": lambda run, tmp: fedloom(["audit", str(run), "--members", "40"]),
    "summary": lambda run, tmp: fedloom(["summary", str(run)]),
    "dashboard": lambda run, tmp: _dashboard(run),
}


def all_cases(run: Path) -> list[Case]:
    """Every location with both targets, under every command."""
    return [
        Case(loc, target, cmd)
        for loc in locations(run)
        for target in ("copy", "absent")
        for cmd in COMMANDS
    ]


def run_case(base: Path, work: Path, case: Case, limit_s: float) -> tuple[Outcome, bool, float]:
    """(outcome, sentinel unchanged, seconds) of ``case`` on a fresh copy of ``base``."""
    work.mkdir(parents=True)
    run = work / "runs" / "run"
    shutil.copytree(base, run, symlinks=True)
    sentinel = work / "sentinel"
    make_sentinel(base, sentinel)
    if case.command == "resume":
        unfinish(run)
        unfinish(sentinel / "copy")
    plant(run, sentinel, case.location, case.target)
    before = tree_digest(sentinel)
    start = time.perf_counter()
    outcome = COMMANDS[case.command](run, work)
    seconds = time.perf_counter() - start
    assert seconds < limit_s, f"{case.id} took {seconds:.1f} s"
    return outcome, tree_digest(sentinel) == before, seconds
