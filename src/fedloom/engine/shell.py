"""The run shell every run family shares: horizontal (engine/loop.py), federated RL
(rl/run.py) and vertical (vertical/run.py). It owns the run directory, the evaluation timing
(``eval.every``, always the last round), metrics.jsonl, checkpoints and bitwise resume, the
wall clock that continues across a resume, and summary.json's common keys (docs/rl.md,
docs/vertical.md: "Run directory").

A family's runner supplies only its rounds: ``shell.resume()`` gives back the state it saved,
``shell.evaluates(done)`` says when to build a metrics row, ``shell.record(row)`` logs it, and
``shell.checkpoint(done, state)`` saves ``{"round", "state", "history", "wall_seconds"}``
every ``checkpoint.every`` rounds and after the last (engine/checkpoint.py writes the files).
The directory is locked for the process that writes it (engine/rundir.py, ``RunLock``): a
second run of it, new or resumed, is refused while the first lives.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from fedloom.engine.checkpoint import Check
from fedloom.engine.checkpoint_fit import shell_fit
from fedloom.engine.rundir import RunDir, default_run_dir
from fedloom.engine.rundir import releasing_locks as releasing_locks  # the families' runners
from fedloom.errors import RunDirError


class CheckpointPolicy(Protocol):
    """The ``checkpoint:`` section (``every``: rounds between checkpoints, None: never;
    ``keep``: how many to keep)."""

    every: int | None
    keep: int


def due(done: int, every: int | None, rounds: int) -> bool:
    """Whether round ``done`` (1-based) is an ``every``-th round or the last one."""
    return every is not None and (done % every == 0 or done == rounds)


def base_summary(
    *,
    algorithm: str,
    dataset: str,
    num_clients: int,
    rounds: int,
    seed: int,
    executor: str,
    final: dict[str, Any],
    communication: dict[str, Any],
    wall_seconds: float,
    seconds_per_round: float,
) -> dict[str, Any]:
    """summary.json's keys common to every run family, in their order (README.md, "Run
    directory"; its readers, ``fedloom compare``, the dashboard and the report rely on them)."""
    return {
        "algorithm": algorithm,
        "dataset": dataset,
        "num_clients": num_clients,
        "rounds": rounds,
        "seed": seed,
        "executor": executor,
        "final": final,
        "communication": communication,
        "wall_seconds": wall_seconds,
        "seconds_per_round": seconds_per_round,
    }


def checkpoint_payload(run_dir: RunDir, check: Check | None = None) -> dict[str, Any]:
    """The newest good checkpoint of ``run_dir`` that passes ``check`` (what the run expects
    of it; engine/checkpoint_fit.py), written under its config (``check_drift``); RunDirError
    when there is none."""
    try:
        saved = run_dir.latest_checkpoint(check)
    except RunDirError:
        # none fits the run: if config.yaml was edited since (another model, say), that is the
        # reason to give, not the damage it looks like from here
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                unchecked = run_dir.latest_checkpoint()
            except RunDirError:
                unchecked = None
        if unchecked is not None:
            run_dir.check_drift(unchecked)
        raise
    if saved is None:
        raise no_checkpoint(run_dir)
    run_dir.check_drift(saved)
    return saved


def no_checkpoint(run_dir: RunDir) -> RunDirError:
    """The refusal to resume a run that stopped before its first checkpoint, with the ways on:
    its config.yaml run again into a new folder, or the folder deleted and reused."""
    every = (run_dir.config or {}).get("checkpoint", {}).get("every")
    why = (
        "it was run without checkpoints (checkpoint.every is not set)"
        if every is None
        else f"it stopped before its first checkpoint (checkpoint.every: {every})"
    )
    return RunDirError(
        f"{run_dir.path} has no checkpoint to resume from: {why}, so there is nothing to "
        f"continue. Start it again in a new folder: `fedloom run {run_dir.config_path} --out "
        "NEW_DIR` (copy config.yaml out and delete the folder first to reuse its name)"
    )


def note_finished(done: int, rounds: int, path: Path) -> None:
    """Warn that a resumed run has nothing left to do (its last round is checkpointed)."""
    if done >= rounds:
        warnings.warn(
            f"{path} finished all {rounds} rounds already: nothing to resume; its summary is "
            "written again from the last checkpoint",
            ResumeWarning,
            stacklevel=2,
        )


class ResumeWarning(UserWarning):
    """Something a resume did not do (a finished run has no rounds left)."""


def open_for_resume(
    path: str | Path,
    parse: Callable[[Any], Any],
    given: Any = None,
    accept_config_change: bool = False,
) -> tuple[RunDir, Any]:
    """The run directory ``path``, locked for this process (``RunDirLocked`` when another one
    writes it), and its parsed config.yaml; RunDirError when ``given`` (a config to check
    against) differs from it."""
    run_dir = RunDir.open_for_writing(path, accept_config_change)
    cfg = parse(run_dir.config_path)
    if given is not None and parse(given).to_dict() != cfg.to_dict():
        raise RunDirError(
            f"cannot resume {run_dir.path}: its config.yaml differs from the given config; "
            "resume without a config, or start a new run"
        )
    run_dir.config = cfg.to_dict()
    return run_dir, cfg


class RunShell:
    """One run's directory, history, clock, evaluation timing and checkpoints."""

    def __init__(
        self,
        run_dir: RunDir | None,
        rounds: int,
        eval_every: int,
        checkpoint: CheckpointPolicy,
    ) -> None:
        self.run_dir = run_dir
        self.rounds, self.eval_every, self.policy = rounds, eval_every, checkpoint
        self.history: list[dict[str, Any]] = []
        self.start_round = 0
        self._start = time.perf_counter()

    @classmethod
    def create(
        cls,
        config_yaml: str,
        name: tuple[str, str],
        out: str | Path | None,
        write: bool,
        **kw: Any,
    ) -> RunShell:
        """A new run: its directory (``out``, else ``runs/<algorithm>-<dataset>-<time>``,
        ``name`` being (algorithm, dataset)) with config.yaml, or none when not ``write``."""
        run_dir = None
        if write:
            run_dir = RunDir.create(out or default_run_dir(*name))
            run_dir.write_config(config_yaml)
        return cls(run_dir, **kw)

    @classmethod
    def open(
        cls,
        config: Any,
        parse: Callable[[Any], Any],
        timing: Callable[[Any], dict[str, Any]],
        out: str | Path | None,
        write: bool,
        resume: str | Path | None,
        accept_config_change: bool = False,
    ) -> tuple[RunShell, Any, Any]:
        """(shell, parsed config, saved state or None): a new run of ``config``, or the run
        directory ``resume`` continued from its newest checkpoint (``config``, if given, must
        be its config.yaml's). ``timing(cfg)``: the shell's ``rounds``, ``eval_every`` and
        ``checkpoint`` of a parsed config."""
        if resume is not None:
            run_dir, cfg = open_for_resume(resume, parse, config, accept_config_change)
            shell = cls(run_dir, **timing(cfg))
            return shell, cfg, shell.resume()
        cfg = parse(config)
        name = (cfg.algorithm.name, cfg.data.name)
        return cls.create(cfg.to_yaml(), name, out, write, **timing(cfg)), cfg, None

    # -- resume -----------------------------------------------------------------------------
    def resume(self) -> Any:
        """The state saved by the newest good checkpoint (history, round and clock restored,
        metrics.jsonl rewritten to match), or None to start afresh (no checkpoint yet)."""
        if self.run_dir is None:
            return None
        saved = self.run_dir.latest_checkpoint(shell_fit)
        if saved is None:
            self.run_dir.rewrite_metrics([])
            return None
        self.run_dir.check_drift(saved)
        note_finished(int(saved["round"]), self.rounds, self.run_dir.path)
        self.history = list(saved["history"])
        self.start_round = int(saved["round"])
        self._start = time.perf_counter() - float(saved["wall_seconds"])
        self.run_dir.rewrite_metrics(self.history)
        return saved["state"]

    # -- the rounds -------------------------------------------------------------------------
    @property
    def elapsed(self) -> float:
        """Seconds since the run started, the time before a resume included."""
        return time.perf_counter() - self._start

    def evaluates(self, done: int) -> bool:
        """Whether round ``done`` is evaluated: every ``eval.every`` rounds and the last."""
        return due(done, self.eval_every, self.rounds)

    def record(self, row: dict[str, Any]) -> None:
        """An evaluated round's metrics row: into the history and metrics.jsonl."""
        self.history.append(row)
        if self.run_dir is not None:
            self.run_dir.append_metrics(row)

    def checkpoint(self, done: int, state: Callable[[], Any]) -> None:
        """Save ``state()`` after round ``done`` when a checkpoint is due (run directories
        only)."""
        if self.run_dir is None or not due(done, self.policy.every, self.rounds):
            return
        payload = {
            "round": done,
            "state": state(),
            "history": self.history,
            "wall_seconds": self.elapsed,
        }
        self.run_dir.save_checkpoint(done, payload, self.policy.keep)

    def finish(self, summary: dict[str, Any]) -> None:
        """Write summary.json (run directories only)."""
        if self.run_dir is not None:
            self.run_dir.write_json("summary.json", summary)
