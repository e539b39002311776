"""The command line: exit statuses, messages that name the key, no lost output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from fedloom.cli import app
from fedloom.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]


def fedloom(*args: str, cwd: Path | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedloom", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=timeout,
    )


def write_config(tmp_path: Path, **sections) -> Path:
    cfg = {
        "data": {"name": "digits", "num_clients": 6},
        "model": {"name": "logreg"},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": 2, "local_steps": 2},
        "eval": {"every": 1},
    }
    for key, value in sections.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.parametrize(
    ("sections", "expected"),
    [
        ({"train": {"lrr": 0.1}}, ["train.lrr", "did you mean", "train.lr"]),
        ({"algorithm": {"name": "fedavgg"}}, ["algorithm.name", "fedavg"]),
        ({"algorithm": {"name": "fedprox", "mu": -1}}, ["algorithm.mu"]),
        ({"algorithm": {"name": "fedprox", "muu": 1}}, ["algorithm.muu", "mu"]),
        ({"train": {"lr": 0}}, ["train.lr", "greater than 0"]),
        ({"train": {"local_epochs": 1, "local_steps": 2}}, ["local_epochs", "local_steps"]),
        ({"train": {"clients_per_round": 50}}, ["train.clients_per_round", "50"]),
        ({"data": {"name": "mnits"}}, ["data.name", "mnist"]),
        ({"data": {"partition": {"kind": "dirichlet", "alpha": 0}}}, ["data.partition.alpha"]),
        (
            {"data": {"partition": {"kind": "shards", "shards_per_client": 50}}},
            ["shards_per_client"],
        ),
        ({"data": {"partition": {"kind": "dirichelt"}}}, ["data.partition.kind", "dirichlet"]),
        ({"model": {"name": "cnnn"}}, ["model.name", "cnn"]),
        ({"executor": {"kind": "gpu"}}, ["executor.kind"]),
        ({"bogus": 1}, ["bogus", "unknown key"]),
    ],
)
def test_config_errors_exit_2_and_name_the_key(tmp_path, sections, expected):
    # in this process (a new `python -m fedloom` costs 2 s of imports each): the commands below
    # check the exit status and messages of the real process
    path = write_config(tmp_path, **sections)
    result = CliRunner().invoke(app, ["run", str(path), "--out", str(tmp_path / "run")])
    assert result.exit_code == 2, result.output
    message = " ".join(result.stderr.split()).lower()
    for needle in expected:
        assert needle.lower() in message, result.stderr
    assert "Traceback" not in result.output
    assert not (tmp_path / "run").exists()


def test_missing_data_file_exits_2_and_names_the_file(tmp_path):
    path = write_config(tmp_path, data={"name": "mnist", "root": str(tmp_path / "empty")})
    proc = subprocess.run(
        [sys.executable, "-m", "fedloom", "run", str(path), "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env={**_env(), "FEDLOOM_OFFLINE": "1"},
    )
    assert proc.returncode == 2, proc.stderr
    assert "train-images-idx3-ubyte.gz" in proc.stderr and str(tmp_path / "empty") in proc.stderr


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def test_set_overrides_and_run_directory(tmp_path):
    path = write_config(tmp_path)
    out = tmp_path / "run"
    proc = fedloom(
        "run",
        str(path),
        "--set",
        "train.rounds=3",
        "--set",
        "algorithm.name=fedprox",
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    assert "personalized accuracy" in proc.stdout
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["train"]["rounds"] == 3 and resolved["algorithm"] == {
        "name": "fedprox",
        "mu": 0.01,
        "mu_schedule": {"kind": "constant", "min": 0.01},
    }
    summary = json.loads((out / "summary.json").read_text())
    assert summary["algorithm"] == "fedprox" and summary["rounds"] == 3


def test_set_algorithm_name_keeps_the_written_algorithm_keys():
    from fedloom.config import apply_overrides

    raw = {"algorithm": {"name": "fedprox", "mu": 0.5}}
    # a key both algorithms have stays; later --set keys land in the new section
    out = apply_overrides(
        {"algorithm": {"name": "fedavg", "server_lr": 0.5}}, ["algorithm.name=scaffold"]
    )
    assert out["algorithm"] == {"name": "scaffold", "server_lr": 0.5}
    # a written key the new algorithm lacks is an error naming it, the algorithm and the file
    with pytest.raises(
        ConfigError,
        match=r"^algorithm\.mu: not a key of algorithm 'fedavg' \(written in my\.yaml\)",
    ):
        apply_overrides(raw, ["algorithm.name=fedavg"], written_in="my.yaml")
    with pytest.raises(ConfigError, match=r"^algorithm\.mu: .* 'scaffold' \(written in --set\)"):
        apply_overrides(
            {"algorithm": {"name": "fedavg"}}, ["algorithm.name=scaffold", "algorithm.mu=1"]
        )
    # the same name keeps the file's keys
    same = apply_overrides(raw, ["algorithm.name=fedprox", "algorithm.mu=3"])
    assert same["algorithm"] == {"name": "fedprox", "mu": 3}
    # the default experiment's keys were written by nobody: its algorithm section starts afresh
    default = {"algorithm": {"name": "fedavg_ft", "finetune_steps": 10}}
    out = apply_overrides(default, ["algorithm.mu=0.5", "algorithm.name=fedprox"], written_in=None)
    assert out["algorithm"] == {"name": "fedprox", "mu": 0.5}


def test_set_partition_kind_keeps_the_written_partition_keys():
    from fedloom.config import apply_overrides

    raw = {"data": {"name": "mnist", "partition": {"kind": "dirichlet", "alpha": 0.5}}}
    with pytest.raises(ConfigError, match=r"^data\.partition\.alpha: not a key of partition 'iid'"):
        apply_overrides(raw, ["data.partition.kind=iid"])
    # the kind's own keys from --set, whatever their order on the command line
    shards = {"data": {"name": "mnist", "partition": {"kind": "iid"}}}
    out = apply_overrides(
        shards, ["data.partition.shards_per_client=3", "data.partition.kind=shards"]
    )
    assert out["data"]["partition"] == {"kind": "shards", "shards_per_client": 3}
    # the same kind keeps the file's keys; the input is not modified
    same = apply_overrides(raw, ["data.partition.kind=dirichlet", "data.partition.min_size=2"])
    assert same["data"]["partition"] == {"kind": "dirichlet", "alpha": 0.5, "min_size": 2}
    assert raw["data"]["partition"] == {"kind": "dirichlet", "alpha": 0.5}
    # no partition in the file (or null): the kind alone
    for data in ({"name": "mnist"}, {"name": "mnist", "partition": None}):
        out = apply_overrides({"data": data}, ["data.partition.kind=iid"])
        assert out["data"]["partition"] == {"kind": "iid"}
    # of the default experiment, the old kind's keys go
    out = apply_overrides(raw, ["data.partition.kind=iid"], written_in=None)
    assert out["data"]["partition"] == {"kind": "iid"}


def test_set_data_name_keeps_the_written_data_keys():
    from fedloom.config import apply_overrides

    raw = {"data": {"name": "synthetic", "num_clients": 5, "partition": {"kind": "iid"}}}
    out = apply_overrides(raw, ["data.name=mnist"])
    assert out["data"] == {"name": "mnist", "num_clients": 5, "partition": {"kind": "iid"}}
    # the old dataset's own options do not exist for the new one
    raw["data"]["synthetic"] = {"alpha": 1.0}
    with pytest.raises(
        ConfigError, match=r"^data\.synthetic: not a key of dataset 'mnist' \(written in f\.yaml\)"
    ):
        apply_overrides(raw, ["data.name=mnist"], written_in="f.yaml")
    # the default experiment's: the new dataset alone, then the --set keys
    out = apply_overrides(raw, ["data.name=mnist", "data.num_clients=3"], written_in=None)
    assert out["data"] == {"name": "mnist", "num_clients": 3}


def test_a_switch_on_the_command_line_keeps_what_the_file_wrote(tmp_path):
    """The bug this replaced: --set data.name / algorithm.name trained on the new choice's
    defaults (partition iid, FedProx's default mu), silently dropping the file's keys."""
    path = write_config(
        tmp_path,
        data={"name": "mnist", "partition": {"kind": "shards", "shards_per_client": 2}},
        train={"rounds": 1},
    )
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**raw, "algorithm": {"mu": 0.5}}))  # no name: --set gives it
    out = tmp_path / "run"
    sets = ("--set", "data.name=digits", "--set", "algorithm.name=fedprox")
    proc = fedloom("run", str(path), *sets, "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["data"]["name"] == "digits" and resolved["data"]["num_clients"] == 6
    assert resolved["data"]["partition"]["kind"] == "shards"
    assert resolved["data"]["partition"]["shards_per_client"] == 2
    assert resolved["algorithm"]["name"] == "fedprox" and resolved["algorithm"]["mu"] == 0.5
    # a written key the new choice lacks: exit 2 naming the key, the choice and the file
    proc = fedloom("run", str(path), "--set", "algorithm.name=fedavg", "--out", str(tmp_path / "b"))
    assert proc.returncode == 2
    assert f"algorithm.mu: not a key of algorithm 'fedavg' (written in {path})" in proc.stderr
    assert not (tmp_path / "b").exists()


def test_set_local_steps_replaces_local_epochs_and_vice_versa():
    from fedloom.config import apply_overrides, parse_config

    raw = {"train": {"rounds": 2, "local_epochs": 1}}
    steps = apply_overrides(raw, ["train.local_steps=5"])
    assert steps["train"] == {"rounds": 2, "local_steps": 5}
    cfg = parse_config(steps)
    assert (cfg.train.local_steps, cfg.train.local_epochs) == (5, None)
    epochs = apply_overrides({"train": {"local_steps": 7}}, ["train.local_epochs=2"])
    assert epochs["train"] == {"local_epochs": 2}
    # a distribution replaces the other key too
    dist = apply_overrides(raw, ["train.local_steps={kind: uniform, low: 1, high: 3}"])
    assert parse_config(dist).train.local_epochs is None
    # unsetting one (null) does not remove the other
    assert apply_overrides({"train": {"local_steps": 7}}, ["train.local_epochs=null"])["train"] == {
        "local_steps": 7,
        "local_epochs": None,
    }
    # both on the command line is still the contradiction it was
    both = apply_overrides(raw, ["train.local_steps=5", "train.local_epochs=2"])
    with pytest.raises(ConfigError, match=r"local_epochs and train\.local_steps"):
        parse_config(both)


EXAMPLES = sorted(  # RL examples (docs/rl.md) have no dataset partition or local budget
    p for p in (ROOT / "examples").glob("*.yaml") if not p.stem.startswith(("frl_", "vfrl_"))
)


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_examples_accept_partition_and_budget_overrides(path):
    """Every example resolves (config and data section, no data loaded) with the partition
    kind switched to one its dataset allows, and with local steps instead of its local work; a
    partition key the file wrote for its own kind is an error naming it (nothing is dropped)."""
    from fedloom.config import apply_overrides, load_yaml, parse_config
    from fedloom.data import PARTITIONS
    from fedloom.data.load import resolve_data_config
    from fedloom.data.spec import DATASETS

    raw = load_yaml(path)
    spec = DATASETS.get(raw["data"]["name"])
    kind = "iid" if "iid" in spec.partitions else spec.default_partition
    sets = [f"data.partition.kind={kind}", "train.local_steps=5"]
    partition = raw["data"].get("partition") or {}
    foreign = [k for k in partition if k not in PARTITIONS.get(kind).model_fields]
    if foreign and partition.get("kind") != kind:
        with pytest.raises(ConfigError, match=rf"^data\.partition\.{foreign[0]}: not a key of"):
            apply_overrides(raw, sets, written_in=str(path))
        raw["data"]["partition"] = {k: v for k, v in partition.items() if k not in foreign}
    cfg = parse_config(apply_overrides(raw, sets))
    assert resolve_data_config(cfg.data)["partition"]["kind"] == kind
    assert (cfg.train.local_steps, cfg.train.local_epochs) == (5, None)


def test_cli_switches_partition_kind_and_local_budget_of_the_default_config(tmp_path):
    """The default experiment (dirichlet alpha, local_epochs, fedavg_ft) with --set partition
    kind iid, local steps and FedProx: it runs, and the run directory's config has the new kind,
    budget and algorithm only (the default's keys of the old choices are replaced)."""
    out = tmp_path / "run"
    proc = fedloom(
        "run",
        *("--set", "data.partition.kind=iid", "--set", "train.local_steps=1"),
        *("--set", "train.rounds=1", "--set", "data.num_clients=6"),
        *("--set", "train.clients_per_round=2", "--set", "model.name=logreg"),
        *("--set", "eval.adaptation_steps=[0]", "--set", "checkpoint.every=null"),
        *("--set", "algorithm.name=fedprox", "--set", "algorithm.mu=0.5"),
        "--out",
        str(out),
    )
    assert proc.returncode == 0, proc.stderr
    resolved = yaml.safe_load((out / "config.yaml").read_text())
    assert resolved["data"]["partition"] == {"kind": "iid"}
    # the default's fedavg_ft keys (finetune_steps) were written by nobody: they go
    assert resolved["algorithm"] == {
        "name": "fedprox",
        "mu": 0.5,
        "mu_schedule": {"kind": "constant", "min": 0.01},
    }
    assert resolved["train"]["local_steps"] == 1 and resolved["train"]["local_epochs"] is None


def test_existing_output_directory_is_never_overwritten(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    proc = fedloom("run", str(write_config(tmp_path)), "--out", str(out))
    assert proc.returncode == 2
    assert "not empty" in proc.stderr
    assert (out / "precious.txt").read_text() == "keep me"
    assert sorted(p.name for p in out.iterdir()) == ["precious.txt"]


def test_unwritable_output_directory_exits_2(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = fedloom("run", str(write_config(tmp_path)), "--out", str(blocker / "run"))
    assert proc.returncode == 2
    assert "cannot write" in proc.stderr or "not empty" in proc.stderr


def test_resume_with_a_different_config_exits_2(tmp_path):
    out = tmp_path / "run"
    assert fedloom("run", str(write_config(tmp_path)), "--out", str(out)).returncode == 0
    before = (out / "metrics.jsonl").read_text()
    other = write_config(tmp_path, train={"lr": 0.5})
    proc = fedloom("run", str(other), "--resume", str(out))
    assert proc.returncode == 2
    assert "train.lr" in proc.stderr
    assert (out / "metrics.jsonl").read_text() == before


def test_resume_of_a_non_run_directory_exits_2(tmp_path):
    proc = fedloom("run", "--resume", str(tmp_path))
    assert proc.returncode == 2
    assert "config.yaml" in proc.stderr


def test_resume_past_a_truncated_newest_checkpoint(tmp_path):
    """Issue #13: the newest checkpoint torn (as by a power cut): --resume warns naming it,
    continues from the older good one, and ends with the uninterrupted run's metrics."""
    config = write_config(tmp_path, train={"rounds": 4}, checkpoint={"every": 2, "keep": 2})
    out = tmp_path / "run"
    assert fedloom("run", str(config), "--out", str(out)).returncode == 0
    full = (out / "metrics.jsonl").read_text().splitlines()
    torn = out / "checkpoints" / "round_000004.safetensors"
    with torn.open("r+b") as f:
        f.truncate(torn.stat().st_size // 2)
    proc = fedloom("run", "--resume", str(out))
    assert proc.returncode == 0, proc.stderr
    assert f"warning: checkpoint {torn} is damaged" in proc.stderr
    resumed = (out / "metrics.jsonl").read_text().splitlines()
    drop = ("wall_seconds", "seconds")
    strip = [{k: v for k, v in json.loads(r).items() if k not in drop} for r in full]
    assert [{k: v for k, v in json.loads(r).items() if k not in drop} for r in resumed] == strip
    # round 4 was written again, good: resuming now has nothing to do, and says only that
    again = fedloom("run", "--resume", str(out)).stderr
    assert again.startswith("warning: ") and "finished all 4 rounds already" in again
    assert "damaged" not in again


def test_resume_with_every_checkpoint_damaged_exits_2_naming_them(tmp_path):
    config = write_config(tmp_path, train={"rounds": 4}, checkpoint={"every": 2, "keep": 2})
    out = tmp_path / "run"
    assert fedloom("run", str(config), "--out", str(out)).returncode == 0
    for name in ("round_000002.safetensors", "round_000004.safetensors"):
        (out / "checkpoints" / name).write_bytes(b"")
    proc = fedloom("run", "--resume", str(out))
    assert proc.returncode == 2
    error = proc.stderr[proc.stderr.index("error:") :]
    assert "no good checkpoint" in error
    assert "round_000002.safetensors" in error and "round_000004.safetensors" in error


def test_algorithms_lists_every_baseline_with_hyperparameters():
    proc = fedloom("algorithms")
    assert proc.returncode == 0
    from fedloom.algorithms import ALGORITHMS

    # fedloom's own: tests run earlier in this process may have registered algorithms of their
    # own (tests/docs registers my_fedsam), which the fresh process cannot know
    for name in ALGORITHMS.names():
        if ALGORITHMS.get(name).__module__.startswith("fedloom."):
            assert any(line.startswith(name + " ") for line in proc.stdout.splitlines()), name
    assert "mu=0.01" in proc.stdout and "finetune_steps=10" in proc.stdout


def test_report_rebuilds_the_html(tmp_path):
    out = tmp_path / "run"
    assert fedloom("run", str(write_config(tmp_path)), "--out", str(out)).returncode == 0
    (out / "report.html").unlink()
    proc = fedloom("report", str(out))
    assert proc.returncode == 0, proc.stderr
    assert (out / "report.html").stat().st_size > 100_000
    assert fedloom("report", str(tmp_path / "nope")).returncode == 2


def test_default_run_starts_on_embedded_data(tmp_path):
    """`fedloom run` with no config file: the embedded default experiment on the bundled digits,
    no download, into ./runs; its first 2 rounds (all 100: the heavy test below)."""
    from fedloom.config import DEFAULT_EXPERIMENT

    proc = fedloom("run", "--set", "train.rounds=2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()

    def given(resolved: dict, wanted: dict) -> dict:  # the keys the default sets, resolved
        return {
            k: given(resolved[k], v) if isinstance(v, dict) else resolved[k]
            for k, v in wanted.items()
        }

    wanted = {**DEFAULT_EXPERIMENT, "train": {**DEFAULT_EXPERIMENT["train"], "rounds": 2}}
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert given(resolved, wanted) == wanted
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dataset"] == "digits" and summary["rounds"] == 2
    assert summary["final"]["global"]["accuracy"] is not None
    # fine-tuned on each client's few classes: measured 0.38 after 2 rounds (chance 0.1)
    assert summary["final"]["personalized"]["accuracy_mean"] > 0.2
    assert (run_dir / "report.html").is_file()


@pytest.mark.heavy(budget=120)  # measured 50 s on a loaded 2-core machine
def test_default_run_finishes_on_embedded_data(tmp_path):
    """`fedloom run` with no argument: bundled digits, no download (about a minute on 2 cores)."""
    proc = fedloom("run", cwd=tmp_path, timeout=900)
    assert proc.returncode == 0, proc.stderr
    (run_dir,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["dataset"] == "digits" and summary["rounds"] == 100
    assert summary["final"]["global"]["accuracy"] > 0.85
    assert (run_dir / "report.html").is_file()


# Runs `python -m fedloom` with `import ray` failing, as if the ray extra were not installed.
WITHOUT_RAY = (
    "import runpy, sys; sys.modules['ray'] = None; sys.argv[0] = 'fedloom'; "
    "runpy.run_module('fedloom', run_name='__main__', alter_sys=True)"
)


def test_ray_executor_without_ray_exits_2_and_says_how_to_install(tmp_path):
    path = write_config(tmp_path, executor={"kind": "ray"})
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY, "run", str(path), "--out", str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 2, proc.stderr
    message = " ".join(proc.stderr.split())
    assert "executor.kind: 'ray'" in message and "pip install 'fedloom[ray]'" in message, message
    assert "Traceback" not in proc.stderr


def test_other_executors_run_without_ray(tmp_path):
    path = write_config(tmp_path, executor={"kind": "auto"}, train={"rounds": 1})
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_RAY, "run", str(path), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    assert (out / "summary.json").exists()


def test_importing_fedloom_does_not_import_ray():
    """Ray is an optional extra: only the Ray executor imports it, and only when built."""
    code = (
        "import importlib, pkgutil, sys, fedloom, fedloom.cli\n"
        "for m in pkgutil.walk_packages(fedloom.__path__, 'fedloom.'):\n"
        "    if m.name != 'fedloom.__main__':\n"
        "        importlib.import_module(m.name)\n"
        "print(sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
