"""``fedloom sweep SPEC.yaml --out DIR``: every cell of a grid at every seed, each an ordinary
run directory, with the tables a paper prints (docs/benchmarks.md).

DIR holds ``sweep.yaml`` (the SPEC with its base config inlined: the same command continues
the sweep, another SPEC is refused naming the first difference), ``cells.json`` (each cell's
directory name, grid values and runs), ``runs/<cell>/seed_<seed>/`` (run directories),
``logs/<cell>/seed_<seed>.log`` (each run's output), ``results.csv``, ``table.md``,
``table.tex`` and ``compare.html``.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from fedloom.core.yaml_text import dump_yaml_text
from fedloom.errors import ConfigError, RunDirError
from fedloom.sweep.jobs import Job, Outcome, run_local, run_ray, run_state
from fedloom.sweep.progress import SweepProgress
from fedloom.sweep.results import columns, run_metrics, write_csv, write_tables
from fedloom.sweep.spec import Sweep, first_difference, load_spec, value_texts

SPEC_FILE = "sweep.yaml"
CELLS_FILE = "cells.json"
RESULTS_FILE = "results.csv"


@dataclass
class SweepResult:
    out: Path
    rows: list[dict[str, Any]]
    """results.csv's rows."""
    ran: int
    """Runs started (or resumed) by this call; the others had finished before."""

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.rows if r["status"] != "finished"]


def cores() -> int:
    """The CPU cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _plain(value: Any) -> Any:
    return yaml.safe_load(yaml.safe_dump(value))


def open_out(out: Path, sweep: Sweep) -> None:
    """Create ``out`` with sweep.yaml, or check that the one there is this sweep's."""
    stored = out / SPEC_FILE
    if out.exists() and not out.is_dir():
        raise RunDirError(f"--out {out} is a file, not a directory")
    if stored.is_file():
        old = yaml.safe_load(stored.read_text(encoding="utf-8"))
        diff = first_difference(old, _plain(sweep.to_dict()))
        if diff is not None:
            key, before, after = diff
            raise RunDirError(
                f"--out {out} holds another sweep: {key} was {before!r} there, is {after!r} "
                f"now; give a new --out, or the SPEC of {stored} to continue it"
            )
        return
    if out.is_dir() and any(out.iterdir()):
        raise RunDirError(
            f"--out {out} exists, is not empty and holds no {SPEC_FILE}: a sweep never writes "
            "into another directory; choose a new --out"
        )
    try:
        out.mkdir(parents=True, exist_ok=True)
        stored.write_text(dump_yaml_text(sweep.to_dict(), sort_keys=False), encoding="utf-8")
    except OSError as err:
        raise RunDirError(f"cannot write --out {out}: {err.strerror}") from None


LOCK_FILE = ".lock"


@contextmanager
def locked(out: Path) -> Iterator[None]:
    """Hold DIR/.lock (an advisory ``flock``, released when the process ends, however it ends)
    for the sweep's duration: two sweeps in one directory would run the same runs twice."""
    try:
        import fcntl
    except ImportError:  # not POSIX: no lock
        yield
        return
    with (out / LOCK_FILE).open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirError(
                f"--out {out}: another fedloom sweep is running there; wait for it, or stop it"
            ) from None
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def plan(sweep: Sweep, out: Path) -> list[Job]:
    """Every run of the sweep, cells in grid order and seeds in SPEC order; writes cells.json."""
    jobs, index = [], []
    for cell in sweep.cells():
        runs = {}
        for seed in sweep.seeds:
            rel = Path("runs", cell.name, f"seed_{seed}")
            runs[str(seed)] = str(rel)
            jobs.append(
                Job(
                    cell=cell.name,
                    seed=seed,
                    config=sweep.config(cell, seed),
                    run_dir=out / rel,
                    log=out / "logs" / cell.name / f"seed_{seed}.log",
                )
            )
        index.append({"name": cell.name, "values": cell.values, "runs": runs})
    (out / CELLS_FILE).write_text(json.dumps(index, indent=2, default=str) + "\n")
    return jobs


def result_row(job: Job, values: dict[str, str], outcome: Outcome | None, out: Path) -> dict:
    """results.csv's row of one run (``outcome`` None: not run yet)."""
    row: dict[str, Any] = {**values, "seed": job.seed, "run_dir": job.run_dir.relative_to(out)}
    if outcome is None:
        return row | {"status": "pending"}
    row |= {"status": outcome.status, "error": outcome.error}
    if outcome.status == "finished":
        row |= run_metrics(job.run_dir)
    return row


def sweep(
    spec: str | Path | Sweep,
    out: str | Path,
    *,
    jobs: int | None = None,
    threads: int | None = None,
    ray: str | None = None,
    progress: bool | None = None,
    compare: bool = True,
) -> SweepResult:
    """Run (or continue) the sweep ``spec`` in ``out`` and write its results and tables.

    ``jobs`` runs at once on this machine (default: the cores), each with ``threads`` torch
    threads (default: cores // jobs, at least 1); ``ray``: a Ray cluster's address instead,
    one task of ``threads`` CPUs (default 1) per run. ``compare``: also write compare.html."""
    sweep = spec if isinstance(spec, Sweep) else load_spec(spec)
    sweep.validate()
    if jobs is not None and jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {jobs}")
    if threads is not None and threads < 1:
        raise ConfigError(f"--threads must be >= 1, got {threads}")
    given = Path(out)
    out = given.absolute()  # the workers (Ray's too) may start elsewhere
    open_out(out, sweep)
    with locked(out):
        return _sweep(sweep, out, given, jobs, threads, ray, progress, compare)


def _sweep(
    sweep: Sweep,
    out: Path,
    given: Path,
    jobs: int | None,
    threads: int | None,
    ray: str | None,
    progress: bool | None,
    compare: bool,
) -> SweepResult:
    all_jobs = plan(sweep, out)
    cells = {c.name: c for c in sweep.cells()}
    values = {name: value_texts(c.values) for name, c in cells.items()}
    outcomes: dict[tuple[str, int], Outcome] = {}
    todo = []
    for job in all_jobs:
        if run_state(job.run_dir) == "finished":
            outcomes[(job.cell, job.seed)] = Outcome(job, "finished")
        else:
            todo.append(job)
    header = columns(list(sweep.grid))
    rows: dict[tuple[str, int], dict[str, Any]] = {
        (j.cell, j.seed): result_row(j, values[j.cell], outcomes.get((j.cell, j.seed)), out)
        for j in all_jobs
    }

    def publish() -> None:
        write_csv(out / RESULTS_FILE, header, list(rows.values()))
        write_tables(out / RESULTS_FILE, out)

    publish()
    if progress is None:
        progress = sys.stderr.isatty()
    with SweepProgress(len(all_jobs), len(all_jobs) - len(todo), progress) as bar:

        def done(outcome: Outcome) -> None:
            job = outcome.job
            try:
                rows[(job.cell, job.seed)] = result_row(job, values[job.cell], outcome, out)
            except Exception as err:  # a finished run whose files cannot be read
                bad = Outcome(job, "failed", error=f"{type(err).__name__}: {err}")
                rows[(job.cell, job.seed)] = result_row(job, values[job.cell], bad, out)
            bar.finish(rows[(job.cell, job.seed)]["status"] != "finished")
            publish()

        if todo and ray is not None:
            run_ray(todo, ray, threads or 1, done, bar.running)
        elif todo:
            workers = min(jobs or cores(), len(todo))
            run_local(todo, workers, threads or max(1, cores() // workers), done, bar.running)
    if compare:
        write_sweep_comparison(
            out, [j for j in all_jobs if rows[(j.cell, j.seed)]["status"] == "finished"]
        )
    return SweepResult(given, list(rows.values()), len(todo))


def write_sweep_comparison(out: Path, finished: list[Job]) -> Path | None:
    """compare.html over the finished runs (each labelled ``<cell>/seed_<seed>``)."""
    if not finished:
        return None
    from fedloom.report.compare import write_comparison

    return write_comparison([j.run_dir for j in finished], out / "compare.html")
