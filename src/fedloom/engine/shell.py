"""The one run shell every run family goes through: horizontal (engine/horizontal.py),
federated RL (rl/run.py) and vertical (vertical/run.py) (docs/architecture.md, "The run
shell"). It owns the run directory (created, or reopened to resume, locked for the process
that writes it: engine/rundir.py, ``RunLock``), the config drift check of a resume, the
evaluation and checkpoint timing (``eval.every``, ``checkpoint.every``, always the last
round), metrics.jsonl, the trackers (TensorBoard, MLflow; engine/tracking.py), the progress
bar (engine/progress.py), the wall clock that continues across a resume, and summary.json.

A family (:class:`RunFamily`) parses its config and builds a :class:`RoundRunner`; the runner
runs only its rounds: ``shell.resume_from(check)`` gives back the checkpoint it saved,
``shell.begin()`` starts the clock's display and trackers, ``shell.evaluates(done)`` says when
to build a metrics row, ``shell.end_round(done, row, payload)`` logs the row and saves the
payload when a checkpoint is due, and the shell writes the summary the runner returns.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from fedloom.engine.checkpoint import Check
from fedloom.engine.checkpoint_fit import shell_fit
from fedloom.engine.progress import RoundProgress
from fedloom.engine.rundir import RunDir, default_run_dir, differing_keys, releasing_locks
from fedloom.engine.tracking import Tracker, make_trackers
from fedloom.errors import ConfigError, RunDirError


@dataclass
class RunResult:
    """What ``fedloom.run`` returns, for every run family (README.md, "Python API")."""

    summary: dict[str, Any]
    history: list[dict[str, Any]]
    global_params: dict[str, torch.Tensor] | None
    client_params: dict[int, dict[str, torch.Tensor]]
    run_dir: RunDir | None = None
    extras: dict[str, Any] = field(default_factory=dict)


class CheckpointPolicy(Protocol):
    """The ``checkpoint:`` section (``every``: rounds between checkpoints, None: never;
    ``keep``: how many to keep)."""

    every: int | None
    keep: int


@dataclass(frozen=True)
class Timing:
    """A run's rounds (iterations, trees), ``eval.every`` and ``checkpoint:`` section."""

    rounds: int
    eval_every: int
    checkpoint: CheckpointPolicy


@dataclass
class RunInputs:
    """What the caller of ``fedloom.run`` hands a run besides its config (README.md, "Python
    API"): its own data, model, executor factory and callbacks, and whether to show progress."""

    data: Any = None
    model: Any = None
    executor: Callable[[Any], Any] | None = None
    callbacks: list[Any] = field(default_factory=list)
    progress: bool = False

    def refuse(self, names: tuple[str, ...], family: str, doc: str) -> None:
        """ConfigError naming the first of ``names`` the caller gave that ``family`` does not
        take (callbacks are hooks of the horizontal round loop)."""
        for name in names:
            if getattr(self, name):
                raise ConfigError(f"{family} takes no {name} ({doc})")


class RoundRunner(Protocol):
    """One built run of a family: what it is named by and its rounds."""

    @property
    def name(self) -> tuple[str, str]:
        """(algorithm, dataset): the default run directory's name."""
        ...

    def save_inputs(self, run_dir: RunDir) -> None:
        """Files of a new run beside config.yaml (the partition, the label histogram)."""

    def run(self, shell: RunShell) -> RunResult:
        """The rounds from ``shell.start_round`` to the end, and the summary."""
        ...


class ConfigRunner:
    """A :class:`RoundRunner` named by its config's ``algorithm.name`` and ``data.name``, with
    nothing to save beside config.yaml (the RL and vertical runners)."""

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg

    @property
    def name(self) -> tuple[str, str]:
        return self.cfg.algorithm.name, self.cfg.data.name

    def save_inputs(self, run_dir: RunDir) -> None:
        """No files beside config.yaml."""


class RunFamily(Protocol):
    """A run family of ``fedloom.run``'s registry (api.py): how its config is read and its
    rounds are built."""

    def check_inputs(self, inputs: RunInputs) -> None:
        """ConfigError for what the caller gave that this family does not take."""

    def parse(self, config: Any, inputs: RunInputs) -> Any:
        """The run's config (defaults resolved) from a path, mapping or parsed config."""
        ...

    def parse_saved(self, path: Path) -> Any:
        """A run directory's config.yaml, parsed."""
        ...

    def timing(self, cfg: Any) -> Timing: ...

    def runner(self, cfg: Any, inputs: RunInputs) -> RoundRunner:
        """The run built (and validated) before a new run's directory is created."""
        ...


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


def config_for_resume(run_dir: RunDir, family: RunFamily, given: Any, inputs: RunInputs) -> Any:
    """The run directory's config.yaml, parsed; RunDirError naming the differing keys when
    ``given`` (a config to check against, or None) is another one."""
    saved = family.parse_saved(run_dir.config_path)
    if given is not None:
        diff = differing_keys(saved.to_dict(), family.parse(given, inputs).to_dict())
        if diff:
            raise RunDirError(
                f"cannot resume {run_dir.path}: its config.yaml differs from the given config "
                f"at {', '.join(diff)}; resume without a config (and without --set), or start "
                "a new run"
            )
    run_dir.config = saved.to_dict()
    return saved


@releasing_locks()  # the run directory's lock ends with the run, whatever its end
def run_family(
    family: RunFamily,
    config: Any,
    inputs: RunInputs,
    *,
    out: str | Path | None,
    resume: str | Path | None,
    write: bool,
    accept_config_change: bool,
) -> RunResult:
    """One run of ``family`` through the shell: a new run of ``config`` (its directory
    ``out``, else ``runs/<algorithm>-<dataset>-<time>``; none unless ``write``), or the run
    directory ``resume`` continued from its newest checkpoint."""
    family.check_inputs(inputs)
    if resume is not None:
        run_dir: RunDir | None = RunDir.open_for_writing(resume, accept_config_change)
        assert run_dir is not None
        cfg = config_for_resume(run_dir, family, config, inputs)
    else:
        if out is not None and write:
            RunDir.check_new(out)  # before any data is loaded (created and locked below)
        cfg, run_dir = family.parse(config, inputs), None
    runner = family.runner(cfg, inputs)  # validates before a directory is made
    resuming = run_dir is not None
    shell = RunShell(run_dir, cfg, family.timing(cfg), runner.name, inputs.progress, resuming)
    if run_dir is None and write:
        shell.create(out, runner)
    return shell.run(runner.run)


class RunShell:
    """One run's directory, history, clock, evaluation timing, checkpoints, metrics log,
    trackers and progress bar."""

    def __init__(
        self,
        run_dir: RunDir | None,
        config: Any,
        timing: Timing,
        name: tuple[str, str],
        progress: bool = False,
        resuming: bool = False,
    ) -> None:
        """A run under ``config`` named ``name`` (algorithm, dataset) in ``run_dir`` (None:
        in memory, or a new run's to ``create``); ``resuming``: continue ``run_dir`` from its
        newest checkpoint."""
        self.run_dir, self.config, self.timing, self.name = run_dir, config, timing, name
        self.rounds = timing.rounds
        self.progress, self.resuming = progress, resuming
        self.history: list[dict[str, Any]] = []
        self.start_round = 0
        self.trackers: list[Tracker] = []
        self.bar: RoundProgress | None = None
        self._start = time.perf_counter()

    def create(self, out: str | Path | None, runner: RoundRunner) -> None:
        """A new run's directory, locked, with config.yaml and the runner's input files."""
        self.run_dir = RunDir.create(out or default_run_dir(*self.name))
        self.run_dir.write_config(self.config.to_yaml())
        runner.save_inputs(self.run_dir)

    # -- resume -----------------------------------------------------------------------------
    def resume_from(self, check: Check) -> dict[str, Any] | None:
        """The newest good checkpoint's payload that passes ``check`` when resuming (None for
        a new run); RunDirError when there is none. The runner restores its state from it and
        calls ``continue_from``."""
        if not self.resuming:
            return None
        assert self.run_dir is not None
        return checkpoint_payload(self.run_dir, check)

    def continue_from(self, done: int, history: list[dict[str, Any]], elapsed: float) -> None:
        """Continue after round ``done`` with the checkpoint's ``history`` (metrics.jsonl
        rewritten to match) and its clock."""
        assert self.run_dir is not None
        note_finished(done, self.rounds, self.run_dir.path)
        self.history, self.start_round = history, done
        self._start = time.perf_counter() - elapsed
        self.run_dir.rewrite_metrics(history)

    def begin(self) -> None:
        """The rounds start: the trackers and the progress bar."""
        run_dir = self.run_dir
        name = run_dir.path.name if run_dir else "-".join(self.name)
        self.trackers = make_trackers(self.config, run_dir.path if run_dir else None, name)
        self.bar = RoundProgress(self.rounds, self.start_round, enabled=self.progress)
        self.bar.__enter__()

    # -- the rounds -------------------------------------------------------------------------
    @property
    def elapsed(self) -> float:
        """Seconds since the run started, the time before a resume included."""
        return time.perf_counter() - self._start

    def evaluates(self, done: int) -> bool:
        """Whether round ``done`` is evaluated: every ``eval.every`` rounds and the last."""
        return due(done, self.timing.eval_every, self.rounds)

    def end_round(
        self, done: int, row: dict[str, Any] | None, payload: Callable[[], dict[str, Any]]
    ) -> None:
        """Round ``done`` has ended: its metrics ``row`` (evaluated rounds) into the history,
        metrics.jsonl, the trackers and the progress bar; ``payload()`` saved when a
        checkpoint is due (run directories only)."""
        if row is not None:
            self.history.append(row)
            if self.run_dir is not None:
                self.run_dir.append_metrics(row)
            for tracker in self.trackers:
                tracker.log(row)
            if self.bar is not None:
                self.bar.show_metrics(row)
        if self.bar is not None:
            self.bar.advance()
        policy = self.timing.checkpoint
        if self.run_dir is not None and due(done, policy.every, self.rounds):
            self.run_dir.save_checkpoint(done, payload(), policy.keep)

    # -- the end ----------------------------------------------------------------------------
    def run(self, rounds: Callable[[RunShell], RunResult]) -> RunResult:
        """``rounds(self)``, then summary.json; on an error, the shell's ``fail``."""
        try:
            result = rounds(self)
        except BaseException:
            self.fail()
            raise
        self.finish(result.summary)
        return result

    def finish(self, summary: dict[str, Any]) -> None:
        """summary.json (run directories only); the trackers get it and close."""
        self._close_bar()
        if self.run_dir is not None:
            self.run_dir.write_json("summary.json", summary)
        for tracker in self.trackers:
            tracker.close(dict(summary))
        self.trackers = []

    def fail(self) -> None:
        """The run stopped on an error: the trackers close as failed, and the directory is
        free to resume at once (a failed run writes no more)."""
        self._close_bar()
        for tracker in self.trackers:
            tracker.close(None, failed=True)
        self.trackers = []
        if self.run_dir is not None:
            self.run_dir.release()

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


def shell_payload(shell: RunShell, done: int, state: Any) -> dict[str, Any]:
    """The checkpoint of a family whose state is its own (RL, vertical):
    ``{"round", "state", "history", "wall_seconds"}`` (engine/checkpoint_fit.py,
    ``ShellPayload``)."""
    return {"round": done, "state": state, "history": shell.history, "wall_seconds": shell.elapsed}


def resume_state(shell: RunShell) -> Any:
    """The state a family of ``shell_payload`` checkpoints saved (None for a new run), the
    shell continued from its round."""
    saved = shell.resume_from(shell_fit)
    if saved is None:
        return None
    shell.continue_from(int(saved["round"]), list(saved["history"]), float(saved["wall_seconds"]))
    return saved["state"]
