"""The runs of a sweep and where they execute: each run (cell x seed) in a process of its own
(``fedloom.sweep.worker``), up to ``jobs`` at once on this machine, or one Ray task per run on
a cluster (``--ray ADDRESS``; the task starts the same worker process on its node, so the sweep
directory must be on a file system every node sees).

A run's state is read from its directory: ``summary.json`` means finished (never run again);
``config.yaml`` with a finished checkpoint means resumable (``fedloom.run(resume=...)``, which
continues bitwise, docs/architecture.md); anything else is removed and started afresh.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from fedloom.engine.rundir import RunDir
from fedloom.errors import ConfigError

State = Literal["finished", "resume", "fresh"]
SUMMARY = "summary.json"
POLL_S = 0.25


@dataclass(frozen=True)
class Job:
    """One run: cell ``cell`` (its directory name) at ``seed``."""

    cell: str
    seed: int
    config: dict[str, Any]
    run_dir: Path
    log: Path


@dataclass(frozen=True)
class Outcome:
    """How a run ended: ``status`` finished or failed, with the error's last line."""

    job: Job
    status: Literal["finished", "failed"]
    error: str = ""
    resumed: bool = False


def run_state(run_dir: Path) -> State:
    """finished (summary.json), resume (config.yaml and a finished checkpoint) or fresh."""
    if (run_dir / SUMMARY).is_file():
        return "finished"
    if (run_dir / "config.yaml").is_file() and RunDir(run_dir).checkpoints():
        return "resume"
    return "fresh"


def execute(job: Job, threads: int) -> Outcome:
    """Run ``job`` in a worker process (output appended to ``job.log``) and say how it ended."""
    state = run_state(job.run_dir)
    if state == "finished":
        return Outcome(job, "finished")
    if state == "fresh" and job.run_dir.exists():  # killed before its first checkpoint
        shutil.rmtree(job.run_dir)
    job.run_dir.parent.mkdir(parents=True, exist_ok=True)
    job.log.parent.mkdir(parents=True, exist_ok=True)
    request = {
        "config": job.config,
        "out": str(job.run_dir),
        "resume": state == "resume",
        "threads": threads,
        "parent": os.getpid(),
    }
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    with job.log.open("ab") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {state}\n".encode())
        log.flush()
        proc = subprocess.run(
            [sys.executable, "-m", "fedloom.sweep.worker"],
            input=json.dumps(request).encode(),
            stdout=log,
            stderr=log,
            env=env,
            check=False,
        )
    resumed = state == "resume"
    if proc.returncode == 0 and (job.run_dir / SUMMARY).is_file():
        return Outcome(job, "finished", resumed=resumed)
    if proc.returncode < 0:
        error = f"killed by signal {-proc.returncode}"
    else:
        error = last_line(job.log) or f"exit status {proc.returncode}"
    return Outcome(job, "failed", error=error, resumed=resumed)


def last_line(path: Path) -> str:
    """The last non-empty line of a log (the worker's error line)."""
    try:
        with path.open("rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 8192))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return ""
    return next((line.strip() for line in reversed(lines) if line.strip()), "")


Tick = Callable[[int], None]
"""Called with the number of runs in progress whenever it may have changed."""


def run_local(
    jobs: list[Job], workers: int, threads: int, done: Callable[[Outcome], None], tick: Tick
) -> None:
    """Run ``jobs`` ``workers`` at a time on this machine, calling ``done`` as each ends."""
    with ThreadPoolExecutor(max_workers=workers) as pool:
        _drain({pool.submit(execute, job, threads) for job in jobs}, workers, done, tick)


def _drain(
    pending: set[Future[Outcome]], slots: int, done: Callable[[Outcome], None], tick: Tick
) -> None:
    while pending:
        tick(min(slots, len(pending)))
        finished, pending = wait(pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
        for future in finished:
            done(future.result())
    tick(0)


def run_ray(
    jobs: Iterable[Job], address: str, threads: int, done: Callable[[Outcome], None], tick: Tick
) -> None:
    """One Ray task per run on the cluster at ``address``, each asking for ``threads`` CPUs."""
    try:
        import ray
    except ImportError:
        raise ConfigError(
            "--ray needs Ray, an optional extra that is not installed: pip install 'fedloom[ray]'"
        ) from None
    from fedloom.engine.ray_executor import _check_reachable

    try:
        _check_reachable(address)
    except ConfigError as err:
        raise ConfigError(str(err).replace("executor.address", "--ray", 1)) from None
    started = not ray.is_initialized()
    if started:
        ray.init(address=address, logging_level="WARNING", log_to_driver=False)
    try:
        task = ray.remote(num_cpus=threads, max_retries=0)(execute)
        refs = {task.remote(job, threads): job for job in jobs}
        slots = max(1, int(ray.cluster_resources().get("CPU", 1) // threads))
        while refs:
            tick(min(slots, len(refs)))
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=POLL_S)
            for ref in ready:
                job = refs.pop(ref)
                try:
                    done(ray.get(ref))
                except Exception as err:  # the task itself failed (node lost, ...)
                    done(Outcome(job, "failed", error=f"Ray task: {type(err).__name__}: {err}"))
        tick(0)
    finally:
        if started:
            ray.shutdown()
