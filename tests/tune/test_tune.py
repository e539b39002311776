"""fedloom tune (docs/tune.md): determinism, one report per round,
resume from the journal, pruned runs freed, the search finds the quadratic's best lr."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import optuna
import pytest

import fedloom
from fedloom.errors import ConfigError, RunDirError
from fedloom.tune import parse_space, tune
from fedloom.tune.objective import TrialReporter
from fedloom.tune.study import JOURNAL_FILE, STUDY_NAME
from tests.tune.oracle import best_lr, quadratic_config

ROOT = Path(__file__).resolve().parents[2]
LR_SPACE = {"train.lr": {"kind": "float", "low": 0.001, "high": 1.0, "log": True}}


def trial_list(result) -> list[tuple[Any, ...]]:
    """What a search did, trial by trial: state, values drawn, rounds, reported curve."""
    return [
        (t.number, t.state, t.params, t.user_attrs.get("rounds"), t.intermediate_values)
        for t in result.study.get_trials()
    ]


def search(tmp: Path, trials: int, rounds: int = 6, **kw: Any):
    return tune(quadratic_config(rounds), parse_space(LR_SPACE), trials, out=tmp, **kw)


def test_same_study_name_and_seed_give_the_same_trial_list(tmp_path):
    a = search(tmp_path / "a", 8)
    b = search(tmp_path / "b", 8)
    assert a.study.study_name == b.study.study_name == STUDY_NAME
    assert trial_list(a) == trial_list(b)
    assert {t.state for t in a.study.get_trials()} == {
        optuna.trial.TrialState.COMPLETE,
        optuna.trial.TrialState.PRUNED,
    }
    other = search(tmp_path / "c", 8, seed=1)
    assert [t[2] for t in trial_list(other)] != [t[2] for t in trial_list(a)]


def test_every_trial_reports_once_per_round_with_increasing_steps(tmp_path, monkeypatch):
    reported: dict[int, list[int]] = {}
    original = optuna.Trial.report

    def spy(self, value, step):
        reported.setdefault(self.number, []).append(step)
        return original(self, value, step)

    monkeypatch.setattr(optuna.Trial, "report", spy)
    result = search(tmp_path, 8, rounds=6)
    assert len(reported) == 8
    for t in result.study.get_trials():
        steps = reported[t.number]
        assert steps == list(range(1, t.user_attrs["rounds"] + 1)), (t.number, steps)
        assert sorted(t.intermediate_values) == steps
    pruned = [t for t in result.study.get_trials() if t.state.name == "PRUNED"]
    assert pruned and all(t.user_attrs["rounds"] < 6 for t in pruned)


def test_resume_between_trials_continues_the_same_search(tmp_path):
    """A search stopped after 4 trials and run again to 9 keeps the 4, runs 5 more, and its
    trial list equals an uninterrupted 9-trial search (the sampler is seeded per trial)."""
    whole = search(tmp_path / "whole", 9)
    first = trial_list(search(tmp_path / "split", 4))
    resumed = search(tmp_path / "split", 9)
    assert len(first) == 4 and trial_list(resumed)[:4] == first
    assert trial_list(resumed) == trial_list(whole)
    assert resumed.summary["trials"]["finished"] == 9
    again = search(tmp_path / "split", 9)  # nothing left to do
    assert trial_list(again) == trial_list(resumed)


KILLER = """
import os, signal, sys
from fedloom.tune.objective import TrialReporter
from fedloom.tune import parse_space, tune
from tests.tune.oracle import quadratic_config
original = TrialReporter.on_round_end
def killed(self, engine, state, report):
    if self.trial.number == 3 and report.round == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    original(self, engine, state, report)
TrialReporter.on_round_end = killed
space = {"train.lr": {"kind": "float", "low": 0.001, "high": 1.0, "log": True}}
tune(quadratic_config(6), parse_space(space), 7, out=sys.argv[1])
"""


def test_killed_search_resumes_without_repeating_finished_trials(tmp_path):
    """SIGKILL inside trial 3 (round 1) leaves it RUNNING in the journal; reopening marks it
    failed, runs its values again, and ends with 7 finished trials, the first 3 untouched."""
    out = tmp_path / "search"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-c", KILLER, str(out)], cwd=ROOT, env=env, capture_output=True
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    storage = optuna.storages.JournalStorage(
        optuna.storages.journal.JournalFileBackend(str(out / JOURNAL_FILE))
    )
    before = optuna.load_study(study_name=STUDY_NAME, storage=storage).get_trials()
    states = [t.state.name for t in before]
    assert states[3:] == ["RUNNING"] and set(states[:3]) <= {"COMPLETE", "PRUNED"}, states
    result = search(out, 7)
    trials = result.study.get_trials()
    finished = [t for t in trials if t.state.name in ("COMPLETE", "PRUNED")]
    assert len(finished) == 7, [(t.number, t.state.name, t.user_attrs) for t in trials]
    for old, new in zip(before[:3], trials[:3], strict=True):
        assert (old.params, old.value, old.intermediate_values) == (
            new.params,
            new.value,
            new.intermediate_values,
        )
    assert trials[3].state.name == "FAIL"
    retry = [t for t in trials if t.user_attrs.get("retry_of") == 3]
    assert len(retry) == 1 and retry[0].params == before[3].params
    numbers = [t.number for t in trials]
    assert len(numbers) == len(set(numbers)) == 8


def test_pruned_runs_are_freed_before_the_next_trial(tmp_path, monkeypatch):
    """A pruned run's engine and per-client state store are gone (reference counting, no gc
    pass) when the next trial starts."""
    refs: list[tuple[int, weakref.ref, weakref.ref]] = []
    alive: list[int] = []

    def on_run_start(self, engine, state):
        alive.extend(n for n, e, s in refs if e() is not None or s() is not None)
        refs.append((self.trial.number, weakref.ref(engine), weakref.ref(state.clients)))

    monkeypatch.setattr(TrialReporter, "on_run_start", on_run_start, raising=False)
    result = search(tmp_path, 8)
    assert result.summary["trials"]["pruned"] > 0
    assert len(refs) == 8 and alive == []


@pytest.mark.parametrize("lr", [0.02, 0.27])
def test_the_oracle_is_what_fedloom_measures(lr):
    """The closed form behind the known optimum equals fedloom's validation loss."""
    import numpy as np

    from tests.tune.oracle import validation_loss

    raw = quadratic_config(8, lr=lr)
    run = fedloom.run(raw, write=False, progress=False)
    measured = run.history[-1]["validation"]["global"]["loss"]
    assert measured == pytest.approx(float(validation_loss(raw, np.array([lr]))[0]), rel=1e-4)


def test_tpe_hyperband_finds_the_best_lr_with_fewer_rounds(tmp_path):
    """docs/tune.md, "Measured": 30 trials of TPE + Hyperband find an lr within 2x of the
    quadratic's best (closed form, tests/tune/oracle.py) spending <= 60% of the rounds of no
    pruning (measured: within 4%, 46-55% over seeds 0-4)."""
    raw = quadratic_config(8)
    optimum = best_lr(raw)
    result = tune(raw, parse_space(LR_SPACE), 30, out=tmp_path)
    found = result.summary["best"]["params"]["train.lr"]
    assert abs(math.log(found / optimum)) <= math.log(2), (found, optimum)
    assert result.summary["rounds_without_pruning"] == 30 * 8
    assert result.summary["rounds_spent"] <= 0.6 * 30 * 8
    written = json.loads((tmp_path / "tune.json").read_text())
    assert written["best"]["params"] == result.summary["best"]["params"]
    assert "train:" in (tmp_path / "best.yaml").read_text()
    page = (tmp_path / "tune.html").read_text()
    assert "fig-history" in page and "fig-intermediate" in page and "<table" in page


@pytest.mark.parametrize(
    ("space", "needle"),
    [
        ({"train.lrr": {"kind": "float", "low": 0.1, "high": 1.0}}, "Did you mean 'train.lr'"),
        ({"train.lr": {"kind": "float", "low": 1.0, "high": 0.1}}, "low < high"),
        ({"train.lr": {"kind": "float", "low": 0.0, "high": 1.0, "log": True}}, "low > 0"),
        ({"train.lr": {"kind": "gaussian"}}, "kind: float | int | categorical"),
        ({"train.lr": {"kind": "float", "low": 0.0, "high": 1.0}}, "train.lr"),
        ({"algorithm.name": {"kind": "categorical", "choices": ["fedavg", "fedavgg"]}}, "fedavg"),
        ({"train.local_steps": {"kind": "int", "low": 1, "high": 3, "stepp": 1}}, "stepp"),
    ],
)
def test_bad_spaces_are_config_errors_naming_the_key(tmp_path, space, needle):
    with pytest.raises(ConfigError) as err:
        tune(quadratic_config(2), parse_space(space), 2, out=tmp_path)
    assert needle in str(err.value)


def test_search_needs_a_validation_split_and_refuses_another_search(tmp_path):
    raw = quadratic_config(2)
    raw["eval"] = {"every": 1}
    with pytest.raises(ConfigError, match="validation_fraction"):
        tune(raw, parse_space(LR_SPACE), 2, out=tmp_path / "a")
    with pytest.raises(ConfigError, match="never the test"):
        search(tmp_path / "t", 2, metric="global.accuracy")
    search(tmp_path / "b", 2, rounds=2)
    with pytest.raises(RunDirError, match="another search"):
        search(tmp_path / "b", 2, rounds=3)


def test_algorithm_hyperparameters_and_categories(tmp_path):
    """mu of FedProx and a categorical key: the runs see the drawn values."""
    raw = quadratic_config(3)
    raw["algorithm"] = {"name": "fedprox", "mu": 0.1}
    space = parse_space(
        {
            "algorithm.mu": {"kind": "float", "low": 0.001, "high": 1.0, "log": True},
            "train.local_steps": {"kind": "categorical", "choices": [1, 2]},
        }
    )
    result = tune(raw, space, 3, out=tmp_path, pruner="none")
    assert result.summary["trials"]["complete"] == 3
    best = result.best_config
    assert best is not None and best.algorithm.name == "fedprox"
    assert best.algorithm.mu == result.summary["best"]["params"]["algorithm.mu"]
    assert best.train.local_steps == result.summary["best"]["params"]["train.local_steps"]


def test_cli_tune_and_its_exit_status(tmp_path):
    """In process (typer's runner): exit 0 with the summary lines, 2 on a bad space."""
    import yaml
    from typer.testing import CliRunner

    from fedloom.cli import app

    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(quadratic_config(3)))
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump(LR_SPACE))
    runner = CliRunner()
    args = ["tune", str(config), "--space", str(space), "--set", "train.rounds=2"]
    done = runner.invoke(
        app, [*args, "--trials", "3", "--out", str(tmp_path / "out"), "--pruner", "sha"]
    )
    assert done.exit_code == 0, done.output
    assert "best trial" in done.stdout and (tmp_path / "out" / "tune.html").is_file()
    assert json.loads((tmp_path / "out" / "tune.json").read_text())["pruner"] == "sha"
    space.write_text("train.lr: {kind: float, low: 1, high: 0.5}\n")
    bad = runner.invoke(app, [*args, "--out", str(tmp_path / "bad")])
    assert bad.exit_code == 2 and "low < high" in bad.output
    wrong = runner.invoke(
        app, [*args[:3], str(tmp_path / "none.yaml"), "--out", str(tmp_path / "c")]
    )
    assert wrong.exit_code == 2 and "not found" in wrong.output


def test_the_example_space_fits_the_example_config():
    """examples/tune/space.yaml names keys of examples/fashion_mnist.yaml (docs/tune.md)."""
    from fedloom.config import apply_overrides, load_yaml
    from fedloom.tune.space import check_space, load_space

    raw = load_yaml(ROOT / "examples" / "fashion_mnist.yaml")
    raw = apply_overrides(raw, ["eval.validation_fraction=0.1"])
    check_space(raw, load_space(ROOT / "examples" / "tune" / "space.yaml"))


def test_default_metric_follows_the_task_and_the_global_model():
    from fedloom.config import parse_config
    from fedloom.tune.search import default_metric

    raw = quadratic_config(2)
    assert default_metric(parse_config(raw)) == "validation.global.loss"
    raw["algorithm"] = {"name": "local"}
    assert default_metric(parse_config(raw)) == "validation.personalized.loss_mean"
