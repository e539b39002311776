"""Every input a clear answer (README.md, "Exit status"): each bad input a new or hostile user
tried gets exit 2 with one line naming the key or file, never exit 1, a traceback or a hang;
nothing is read or written outside the folders asked for; a resumed run refuses a changed
config; every JSON file fedloom writes is strict JSON."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import yaml

from fedloom.core.files import strict_json
from fedloom.dashboard.runs import RunsFolder
from fedloom.engine.rundir import RunDir
from tests.cli.invoke import QUADRATIC, fedloom, write_yaml


def strict_load(text: str):
    """json.loads that refuses NaN and Infinity, as strict parsers do."""

    def refuse(name: str):
        raise ValueError(f"non-standard JSON constant {name}")

    return json.loads(text, parse_constant=refuse)


@pytest.fixture
def config(tmp_path: Path) -> Path:
    return write_yaml(tmp_path / "config.yaml", QUADRATIC)


DIGITS = {
    "data": {"name": "digits", "num_clients": 4},
    "model": {"name": "logreg"},
    "algorithm": {"name": "fedavg"},
    "train": {"rounds": 1, "local_steps": 1},
}


# -- parse-time errors: each names its key -------------------------------------------------
@pytest.mark.parametrize(
    ("sets", "needle"),
    [
        (["privacy.kind=client_dp", "privacy.noise_multiplier=.inf"], "privacy.noise_multiplier"),
        (["privacy.kind=client_dp", "privacy.noise_multiplier=1", "privacy.clip=.inf"], "clip"),
        (["train.lr=.inf"], "train.lr: Input should be a finite number"),
        (["train.lr=.nan"], "train.lr"),
        (["train.lr=[1"], "--set 'train.lr=[1': the value is not a YAML"),
        (["train.lr=!!python/object:os.system x"], "--set"),
        (["seed=1180591620717411303424"], "seed:"),
        (["seed=-1"], "seed:"),
        (["secure_aggregation.kind=secagg", "secure_aggregation.threshold=9"], "threshold: 9"),
        (["aggregator.kind=multi_krum", "aggregator.m=9"], "aggregator.m: multi_krum"),
        (["incentive.kind=equal", "incentive.budget=.inf"], "incentive.budget"),
        (
            [
                "asynchrony.kind=fedbuff",
                "asynchrony.speeds.kind=per_client",
                "asynchrony.speeds.values=[1, .nan, 1, 1, 1, 1]",
            ],
            "asynchrony.speeds.values",
        ),
        (["asynchrony.kind=fedbuff", "asynchrony.speeds.sigma=.inf"], "speeds.sigma"),
    ],
)
def test_bad_values_exit_2_naming_the_key(config, sets, needle):
    out = fedloom(["run", str(config), *[a for s in sets for a in ("--set", s)]])
    assert out.is_clear_input_error(), (out.code, out.stderr)
    assert needle in out.stderr


def test_a_binary_file_as_the_config_exits_2(tmp_path):
    binary = tmp_path / "model.bin"
    binary.write_bytes(bytes(range(256)) * 4)
    out = fedloom(["run", str(binary)])
    assert out.is_clear_input_error(), out.stderr
    assert "not UTF-8" in out.stderr


@pytest.mark.parametrize(
    ("attack", "needle"),
    [
        ({"kind": "label_flip", "mode": "all_to_one", "target": 99}, "attack.target: class 99"),
        ({"kind": "backdoor", "target": 1, "trigger": {"size": 9}}, "attack.trigger.size"),
    ],
)
def test_attacks_that_do_not_fit_the_data_exit_2(tmp_path, attack, needle):
    path = write_yaml(tmp_path / "c.yaml", {**DIGITS, "attack": {"fraction": 0.5, **attack}})
    out = fedloom(["run", str(path), "--out", str(tmp_path / "run")])
    assert out.is_clear_input_error(), out.stderr
    assert needle in out.stderr


def test_feature_aware_aggregation_on_an_rl_config_exits_2(tmp_path):
    path = write_yaml(
        tmp_path / "rl.yaml",
        {"data": {"name": "cartpole"}, "aggregator": {"kind": "feature_aware"}},
    )
    out = fedloom(["run", str(path)])
    assert out.is_clear_input_error(), out.stderr
    assert "feature_aware" in out.stderr


def test_a_search_space_with_an_infinite_bound_exits_2(config, tmp_path):
    space = write_yaml(
        tmp_path / "space.yaml", {"train.lr": {"kind": "float", "low": 0.01, "high": math.inf}}
    )
    out = fedloom(["tune", str(config), "--space", str(space), "--out", str(tmp_path / "t")])
    assert out.is_clear_input_error(), out.stderr
    assert "high" in out.stderr


# -- run directories: unreadable files, containment, drift ---------------------------------
@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished two-round run with a serving section (deployable models)."""
    root = tmp_path_factory.mktemp("finished")
    path = write_yaml(root / "c.yaml", {**QUADRATIC, "serving": {"ema": 0.9}})
    out = fedloom(["run", str(path), "--out", str(root / "run")])
    assert out.code == 0, out.stderr
    return root / "run"


def copy_run(run: Path, to: Path) -> Path:
    import shutil

    return Path(shutil.copytree(run, to))


@pytest.mark.parametrize(
    ("damaged", "command"),
    [
        ("config.yaml", ["run", "--resume"]),
        ("config.yaml", ["audit"]),
        ("summary.json", ["summary"]),
        ("config.yaml", ["export"]),
    ],
)
def test_run_directory_files_that_are_not_utf8_exit_2(finished_run, tmp_path, damaged, command):
    run = copy_run(finished_run, tmp_path / "run")
    (run / damaged).write_bytes(b"\xff\xfe\x00bad")
    out = fedloom([*command, str(run)])
    assert out.is_clear_input_error(), (out.code, out.stderr)
    assert damaged in out.stderr


def test_export_stays_inside_the_run_and_the_out_folder(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    meta_path = run / "serving" / "serving.json"
    meta = json.loads(meta_path.read_text())
    outside = tmp_path / "escaped.safetensors"
    (run / "escaped.safetensors").write_bytes((run / "serving" / "ema.safetensors").read_bytes())
    meta["files"]["global"] = "../escaped.safetensors"
    meta_path.write_text(json.dumps(meta))
    out = fedloom(["export", str(run), "--out", str(tmp_path / "export")])
    assert out.is_clear_input_error(), out.stderr
    assert "points outside" in out.stderr
    assert not outside.exists() and not (tmp_path / "export" / "global.safetensors").exists()


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda m: m.pop("model"), "missing model"),
        (lambda m: m["files"].update(bogus="bogus.safetensors"), "unknown copies"),
    ],
)
def test_export_of_a_damaged_serving_json_exits_2(finished_run, tmp_path, edit, needle):
    run = copy_run(finished_run, tmp_path / "run")
    meta_path = run / "serving" / "serving.json"
    meta = json.loads(meta_path.read_text())
    edit(meta)
    meta_path.write_text(json.dumps(meta))
    out = fedloom(["export", str(run), "--out", str(tmp_path / "export")])
    assert out.is_clear_input_error(), out.stderr
    assert needle in out.stderr


def test_export_writes_only_its_own_file_names(finished_run, tmp_path):
    out = fedloom(["export", str(finished_run), "--out", str(tmp_path / "export")])
    assert out.code == 0, out.stderr
    written = sorted(p.name for p in (tmp_path / "export").rglob("*") if p.is_file())
    assert written == ["card.json", "ema.safetensors", "global.safetensors"]
    strict_load((tmp_path / "export" / "card.json").read_text())


def test_the_dashboard_lists_no_run_outside_its_folder(finished_run, tmp_path):
    runs = tmp_path / "runs"
    runs.mkdir()
    copy_run(finished_run, runs / "inside")
    os.symlink(finished_run, runs / "linked_run")
    linked_file = copy_run(finished_run, runs / "linked_config")
    (linked_file / "config.yaml").unlink()
    os.symlink(finished_run / "config.yaml", linked_file / "config.yaml")
    folder = RunsFolder(runs)
    assert folder.names() == ["inside"]
    assert folder.path_of("linked_run") is None and folder.path_of("linked_config") is None


def test_resume_refuses_a_changed_config_naming_the_key(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    checkpoints = sorted((run / "checkpoints").glob("round_*.json"))
    (checkpoints[-1]).unlink()  # resume from round 1
    (checkpoints[-1].with_suffix(".safetensors")).unlink()
    raw = yaml.safe_load((run / "config.yaml").read_text())
    raw["train"]["lr"] = 0.07
    (run / "config.yaml").write_text(yaml.safe_dump(raw))
    out = fedloom(["run", "--resume", str(run)])
    assert out.is_clear_input_error(), out.stderr
    assert "train.lr was 0.05" in out.stderr and "is 0.07 now" in out.stderr
    accepted = fedloom(["run", "--resume", str(run), "--accept-config-change"])
    assert accepted.code == 0, accepted.stderr
    assert "warning: resuming under a changed config: train.lr" in accepted.stderr
    manifest = json.loads(sorted((run / "checkpoints").glob("round_*.json"))[-1].read_text())
    assert len(manifest["config_sha256"]) == 64


def test_resume_after_the_model_was_changed_exits_2(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    raw = yaml.safe_load((run / "config.yaml").read_text())
    raw["model"]["name"] = "mlp"
    (run / "config.yaml").write_text(yaml.safe_dump(raw))
    out = fedloom(["run", "--resume", str(run)])
    assert out.is_clear_input_error(), out.stderr
    assert "model.name was 'logreg'" in out.stderr


def test_resuming_a_finished_run_says_there_is_nothing_to_do(finished_run, tmp_path):
    run = copy_run(finished_run, tmp_path / "run")
    out = fedloom(["run", "--resume", str(run)])
    assert out.code == 0, out.stderr
    assert "finished all 2 rounds already: nothing to resume" in out.stderr


# -- silent outcomes and strict JSON -------------------------------------------------------
def test_every_client_dropped_warns_and_json_stays_strict(tmp_path):
    path = write_yaml(
        tmp_path / "c.yaml",
        {**QUADRATIC, "train": {**QUADRATIC["train"], "lr": 1e30, "nonfinite": "drop"}},
    )
    out = fedloom(["run", str(path), "--out", str(tmp_path / "run")])
    assert out.code == 0, out.stderr
    assert "every client's result was non-finite and dropped" in out.stderr
    for name in ("summary.json", "metrics.jsonl"):
        for line in (tmp_path / "run" / name).read_text().splitlines():
            if name.endswith(".jsonl"):
                strict_load(line)
        if name.endswith(".json"):
            strict_load((tmp_path / "run" / name).read_text())


def test_non_finite_numbers_are_written_as_null(tmp_path):
    run = RunDir.create(tmp_path / "run")
    run.write_json("summary.json", {"final": {"global": {"loss": math.nan, "x": [math.inf]}}})
    assert strict_load((tmp_path / "run" / "summary.json").read_text()) == {
        "final": {"global": {"loss": None, "x": [None]}}
    }
    assert strict_json({"a": -math.inf}) == '{"a": null}'


def test_a_trial_is_never_pruned_at_its_last_round():
    from types import SimpleNamespace

    from fedloom.tune.objective import TrialReporter

    class AlwaysPrune:
        def report(self, value: float, step: int) -> None:
            pass

        def should_prune(self) -> bool:
            return True

    import optuna

    reporter = TrialReporter(AlwaysPrune(), "validation.global.loss")  # type: ignore[arg-type]
    ctx = SimpleNamespace(config=SimpleNamespace(train=SimpleNamespace(rounds=3)))
    metrics = {"validation": {"global": {"loss": 1.0}}}
    with pytest.raises(optuna.TrialPruned):
        reporter.on_round_end(ctx, None, SimpleNamespace(round=2, evaluate=True, metrics=metrics))
    assert (
        reporter.on_round_end(ctx, None, SimpleNamespace(round=3, evaluate=True, metrics=metrics))
        == {}
    )


# -- the newcomer's path ---------------------------------------------------------------------
@pytest.mark.parametrize("dataset", ["quadratic", "cartpole"])
def test_switching_the_dataset_without_a_config_file_starts_fresh(tmp_path, dataset):
    out = fedloom(
        [
            "run",
            "--set",
            f"data.name={dataset}",
            "--set",
            "train.rounds=1",
            "--out",
            str(tmp_path / "r"),
        ]
    )
    assert out.code == 0, out.stderr
    saved = yaml.safe_load((tmp_path / "r" / "config.yaml").read_text())
    assert saved["data"]["name"] == dataset
    assert (saved["data"].get("partition") or {}).get("kind") != "dirichlet"


def test_an_error_from_the_default_experiment_says_so():
    out = fedloom(["run", "--set", "data.num_clients=5"])
    assert out.is_clear_input_error(), out.stderr
    assert "train.clients_per_round" in out.stderr and "built-in default experiment" in out.stderr


def test_algorithms_lists_every_family_and_help_shows_the_extras():
    listed = fedloom(["algorithms"]).stdout
    for name in ("fedavg", "pavg", "qavg", "secureboost", "ftl"):
        assert name in listed
    assert "fedloom[flower]" in fedloom(["flower", "--help"]).stdout
    assert "pip install" in fedloom(["--help"]).stdout or "flower" in fedloom(["--help"]).stdout
