"""One trial of ``fedloom tune``: a fedloom run with the trial's values whose every evaluation
reports the validation metric to Optuna, pruned when the pruner says so.

The metric is read from the evaluated round's metrics row (``validation.global.accuracy``
...): the validation split (``eval.validation_fraction``), never the test sets, so that the
test numbers of the chosen config stay an unbiased estimate (Kuo et al. 2023 and FedHPO-Bench
both select on validation)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import optuna

from fedloom.api import run as run_api
from fedloom.config import RunConfig, parse_config
from fedloom.engine.context import Callback, RunContext
from fedloom.engine.nonfinite import DivergenceError
from fedloom.errors import ConfigError
from fedloom.tune.space import SearchSpace, apply_params, suggest

if TYPE_CHECKING:
    from fedloom.engine.state import RoundReport, RunState


def metric_value(row: dict[str, Any], path: str) -> float | None:
    """The number at dotted ``path`` of a metrics row, or None where it is absent."""
    node: Any = row
    for key in path.split("."):
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return float(node) if isinstance(node, int | float) and not isinstance(node, bool) else None


def direction_of(metric: str) -> str:
    """Losses are minimized, everything else (accuracies) maximized."""
    return "minimize" if "loss" in metric.rsplit(".", 1)[-1] else "maximize"


class TrialReporter(Callback):
    """Reports the metric of every evaluated round as ``trial.report(value, step=round)``
    and stops the run (``optuna.TrialPruned``) when the pruner prunes the trial."""

    def __init__(self, trial: optuna.Trial, metric: str) -> None:
        self.trial = trial
        self.metric = metric
        self.rounds = 0
        """Rounds trained so far (the resource this trial spent)."""
        self.values: list[tuple[int, float]] = []

    def on_round_end(self, ctx: RunContext, state: RunState, report: RoundReport) -> dict[str, Any]:
        self.rounds = report.round
        if not report.evaluate:
            return {}
        value = metric_value(report.metrics, self.metric)
        if value is None:
            raise ConfigError(
                f"--metric {self.metric}: not in the round's metrics (validation needs "
                "eval.validation_fraction > 0; an algorithm without a global model has only "
                "validation.personalized.*)"
            )
        if not math.isfinite(value):
            raise DivergenceError(f"{self.metric} is {value} in round {report.round}")
        self.trial.report(value, step=report.round)
        self.values.append((report.round, value))
        # the last round's value is the trial's result: pruning there would only discard it
        if report.round < ctx.config.train.rounds and self.trial.should_prune():
            raise optuna.TrialPruned(f"pruned at round {report.round}")
        return {}


class Objective:
    """``study.optimize``'s function: base config + the trial's values -> the last reported
    validation value. A run that diverges counts as pruned at the round it diverged (it tells
    TPE that region is bad, which a failed trial would not)."""

    def __init__(self, raw: dict[str, Any], space: SearchSpace, metric: str) -> None:
        self.raw = raw
        self.space = space
        self.metric = metric

    def config(self, params: dict[str, Any]) -> RunConfig:
        return parse_config(apply_params(self.raw, params))

    def __call__(self, trial: optuna.Trial) -> float:
        cfg = self.config(suggest(trial, self.space))
        reporter = TrialReporter(trial, self.metric)
        stopped: str | None = None
        try:
            run_api(cfg, write=False, progress=False, callbacks=[reporter])
        except optuna.TrialPruned as err:
            stopped = str(err)
        except DivergenceError as err:
            trial.set_user_attr("diverged", str(err).splitlines()[0])
            stopped = f"diverged in round {reporter.rounds}"
        finally:
            trial.set_user_attr("rounds", reporter.rounds)
        # the exception and its frames (the engine, every client's state) are freed here, by
        # reference counting, before the next trial starts (tests/tune: no gc pass needed)
        if stopped is not None:
            raise optuna.TrialPruned(stopped)
        if not reporter.values:
            raise ConfigError(f"--metric {self.metric}: the run evaluated no round")
        return reporter.values[-1][1]
