"""``fedloom tune``: a resumable multi-fidelity search over any config keys (docs/tune.md).

The search directory (``--out``) holds ``journal.log`` (the Optuna study), ``trials.json``
(one row per trial), ``tune.json`` (best trial, rounds spent), ``best.yaml`` (the best trial's
fully resolved config, ready for ``fedloom run``) and ``tune.html`` (results table and
Optuna's plots). Running the same command again continues the search: finished trials are
kept, an interrupted one is run again, and the search stops at ``trials`` finished trials.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from fedloom.algorithms import ALGORITHMS
from fedloom.config import RunConfig, parse_config
from fedloom.data import load_dataset
from fedloom.engine.rundir import default_run_dir
from fedloom.errors import ConfigError
from fedloom.horizontal import resolve_defaults
from fedloom.tune.objective import Objective, direction_of
from fedloom.tune.space import SearchSpace, check_space
from fedloom.tune.study import (
    FINISHED,
    STUDY_NAME,
    PrunerKind,
    check_out_dir,
    finished_trials,
    make_pruner,
    open_study,
)

AUTO = "auto"
BEST_FILE = "best.yaml"
TRIALS_FILE = "trials.json"
SUMMARY_FILE = "tune.json"


@dataclass
class TuneResult:
    study: optuna.Study
    summary: dict[str, Any]
    """What ``tune.json`` holds."""
    trials: list[dict[str, Any]]
    """One row per trial (``trials.json``)."""
    best_config: RunConfig | None
    out: Path


def default_metric(cfg: RunConfig) -> str:
    """The global model's validation accuracy (classification) or loss (regression); for an
    algorithm without a global model, the mean over clients of their deployed models'."""
    classification = load_dataset(cfg.data, cfg.seed).task == "classification"
    if ALGORITHMS.get(cfg.algorithm.name).capabilities.has_global_model:
        return "validation.global." + ("accuracy" if classification else "loss")
    return "validation.personalized." + ("accuracy_mean" if classification else "loss_mean")


def check_validation(cfg: RunConfig, space: SearchSpace) -> None:
    if cfg.eval.validation_fraction <= 0 and "eval.validation_fraction" not in space:
        raise ConfigError(
            "fedloom tune selects on a validation split, never the test sets: set "
            "eval.validation_fraction (e.g. --set eval.validation_fraction=0.1)"
        )


def trial_row(trial: FrozenTrial) -> dict[str, Any]:
    """One trial as ``trials.json`` shows it."""
    steps = sorted(trial.intermediate_values)
    return {
        "number": trial.number,
        "state": trial.state.name.lower(),
        "params": trial.params,
        "value": trial.value,
        "last_reported": trial.intermediate_values[steps[-1]] if steps else None,
        "rounds": trial.user_attrs.get("rounds", steps[-1] if steps else 0),
        "steps": steps,
        **({"diverged": trial.user_attrs["diverged"]} if "diverged" in trial.user_attrs else {}),
        **({"retry_of": trial.user_attrs["retry_of"]} if "retry_of" in trial.user_attrs else {}),
    }


def tune(
    raw: dict[str, Any],
    space: SearchSpace,
    trials: int,
    out: str | Path | None = None,
    pruner: PrunerKind = "hyperband",
    seed: int | None = None,
    metric: str = AUTO,
    log: Callable[[str], None] | None = None,
) -> TuneResult:
    """Search ``space`` around the base config ``raw`` until ``trials`` trials have finished
    (complete or pruned) in ``out``; returns the study and what was written.

    ``seed`` seeds the sampler (default: the config's seed); the runs themselves keep the
    config's seed, so every trial sees the same data split and initial model."""
    if trials < 1:
        raise ConfigError(f"--trials must be >= 1, got {trials}")
    cfg = resolve_defaults(parse_config(raw))
    check_space(raw, space)
    check_validation(cfg, space)
    if metric == AUTO:
        metric = default_metric(cfg)
    elif not metric.startswith("validation."):
        raise ConfigError(
            f"--metric {metric}: a search selects on the validation split, never the test "
            "sets: give a key under validation (validation.global.accuracy, "
            "validation.personalized.accuracy_mean, ...)"
        )
    direction = direction_of(metric)
    seed = cfg.seed if seed is None else seed
    out = (
        Path(out)
        if out is not None
        else default_run_dir(f"tune-{cfg.algorithm.name}", cfg.data.name)
    )
    check_out_dir(out)
    rounds, every = cfg.train.rounds, cfg.eval.every
    definition = {
        "config": cfg.to_dict(),
        "space": {k: d.model_dump() for k, d in space.items()},
        "metric": metric,
        "direction": direction,
        "pruner": pruner,
        "seed": seed,
    }
    _quiet_optuna()
    study = open_study(
        out, definition, direction, make_pruner(pruner, min(every, rounds), rounds), seed
    )
    objective = Objective(raw, space, metric)
    remaining = trials - len(finished_trials(study))
    if remaining > 0:
        study.optimize(
            objective,
            n_trials=remaining,
            n_jobs=1,
            callbacks=[_progress(log, trials)] if log is not None else None,
        )
    return write_results(study, objective, out, rounds, pruner, seed)


def write_results(
    study: optuna.Study,
    objective: Objective,
    out: Path,
    rounds: int,
    pruner: str,
    seed: int,
) -> TuneResult:
    """trials.json, tune.json, best.yaml and tune.html from the study's finished trials."""
    from fedloom.tune.page import write_page

    rows = [trial_row(t) for t in study.get_trials(deepcopy=False)]
    done = [r for r in rows if r["state"] in {s.name.lower() for s in FINISHED}]
    spent = sum(r["rounds"] for r in done)
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    definition = study.user_attrs["definition"]
    summary: dict[str, Any] = {
        "study_name": STUDY_NAME,
        "metric": definition["metric"],
        "direction": definition["direction"],
        "pruner": pruner,
        "seed": seed,
        "trials": {
            "finished": len(done),
            "complete": len(complete),
            "pruned": sum(r["state"] == "pruned" for r in done),
            "failed": sum(r["state"] == "fail" for r in rows),
        },
        "rounds_spent": spent,
        "rounds_without_pruning": len(done) * rounds,
        "best": None,
    }
    best_config = None
    if complete:
        best = study.best_trial
        best_config = resolve_defaults(objective.config(best.params))
        (out / BEST_FILE).write_text(best_config.to_yaml())
        summary["best"] = {
            "number": best.number,
            "value": best.value,
            "params": best.params,
            "config": BEST_FILE,
        }
    (out / TRIALS_FILE).write_text(_json(rows))
    (out / SUMMARY_FILE).write_text(_json(summary))
    write_page(study, summary, rows, out)
    return TuneResult(study, summary, rows, best_config, out)


def _json(value: Any) -> str:
    import json

    return json.dumps(value, indent=2, default=str)


def _quiet_optuna() -> None:
    """Optuna logs every trial at INFO; fedloom prints its own line per trial."""
    optuna.logging.set_verbosity(logging.WARNING)


def _progress(
    log: Callable[[str], None], total: int
) -> Callable[[optuna.Study, FrozenTrial], None]:
    def report(study: optuna.Study, trial: FrozenTrial) -> None:
        row = trial_row(trial)
        done = len(finished_trials(study))
        params = ", ".join(f"{k}={_short(v)}" for k, v in trial.params.items())
        value = row["value"] if row["value"] is not None else row["last_reported"]
        shown = "-" if value is None else f"{value:.4g}"
        log(
            f"trial {trial.number} [{done}/{total}] {row['state']} after {row['rounds']} rounds: "
            f"{shown}  ({params})"
        )

    return report


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
