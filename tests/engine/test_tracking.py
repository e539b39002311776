"""The optional exporters (engine/tracking.py): TensorBoard event files and an MLflow run hold
the same numbers as metrics.jsonl."""

from __future__ import annotations

import pytest

import fedloom
from fedloom.engine.tracking import scalars
from fedloom.errors import ConfigError
from tests.resume import Crash, CrashAt


def config(**tracking) -> dict:
    return {
        "seed": 0,
        "data": {"name": "digits", "num_clients": 4, "partition": {"kind": "iid"}},
        "model": {"name": "logreg"},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": 3, "local_steps": 2, "batch_size": 32},
        "eval": {"every": 1},
        # the exporters, not the executor, are under test: no forked workers (auto may fork)
        "executor": {"kind": "sequential"},
        "tracking": tracking,
    }


def test_scalars_flatten_numbers_and_skip_per_client_tables():
    row = {
        "round": 3,
        "train_loss": 0.5,
        "global": {"accuracy": 0.9, "loss": None},
        "client_accuracy": [0.1, 0.2],
        "monitor": {"update_norm": {"p50": 2.0}, "cosine": {"matrix": [[1.0]]}, "zeta2": 0.3},
        "flag": True,
    }
    assert scalars(row) == {
        "train_loss": 0.5,
        "global/accuracy": 0.9,
        "monitor/update_norm/p50": 2.0,
        "monitor/zeta2": 0.3,
    }


def test_tensorboard_scalars_equal_the_metrics(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = fedloom.run(config(tensorboard=True), out=tmp_path / "run", progress=False)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    accuracy = events.Scalars("personalized/accuracy_mean")
    assert [e.step for e in accuracy] == [1, 2, 3]
    expected = [row["personalized"]["accuracy_mean"] for row in result.history]
    assert [e.value for e in accuracy] == pytest.approx(expected, rel=1e-6)
    assert "monitor/zeta2" in events.Tags()["scalars"]


def test_tensorboard_needs_a_run_directory():
    pytest.importorskip("tensorboard")
    with pytest.raises(ConfigError, match=r"tracking\.tensorboard"):
        fedloom.run(config(tensorboard=True), write=False, progress=False)


def test_mlflow_run_holds_params_metrics_and_summary(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    # a file store keeps the test serverless; MLflow 3 wants it opted into explicitly
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    result = fedloom.run(
        config(mlflow=uri, experiment="fedloom-test"), out=tmp_path / "run", progress=False
    )
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("fedloom-test")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.data.params["algorithm.name"] == "fedavg"
    assert run.info.run_name == "run"
    history = client.get_metric_history(run.info.run_id, "global.accuracy")
    assert [m.step for m in history] == [1, 2, 3]
    expected = [row["global"]["accuracy"] for row in result.history]
    assert [m.value for m in history] == pytest.approx(expected, rel=1e-6)
    assert run.info.status == "FINISHED"


def test_a_failed_run_ends_its_mlflow_run_as_failed(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from fedloom.config import parse_config
    from fedloom.data import load_dataset
    from fedloom.engine.loop import Engine
    from fedloom.models import build_model

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    cfg = parse_config(config(mlflow=uri, experiment="failing"))
    data = load_dataset(cfg.data, cfg.seed)
    module = build_model(cfg.model.name, data.input_shape, data.num_outputs)

    with pytest.raises(Crash, match="killed"):
        Engine(cfg, data, module, callbacks=[CrashAt(2)]).run()
    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("failing").experiment_id])
    assert run.info.status == "FAILED"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "global.accuracy")] == [1]


RL = {
    "kind": "rl",
    "seed": 0,
    "data": {"name": "cartpole", "num_clients": 2, "envs_per_client": 2},
    "model": {"hidden": [8]},
    "algorithm": {"name": "pavg"},
    "train": {"rounds": 2, "local_steps": 1},
    "eval": {"every": 1, "episodes": 1},
}
VERTICAL = {
    "kind": "vertical",
    "seed": 0,
    "data": {
        "name": "breast_cancer",
        "partition": {"kind": "vertical", "parties": [[0, 10], [10, 30]]},
    },
    "algorithm": {"name": "vertical_logistic", "iterations": 2},
    "secure_aggregation": {"kind": "none"},
    "eval": {"every": 1},
}


@pytest.mark.parametrize(("family", "tag"), [(RL, "return_mean"), (VERTICAL, "global/auc")])
def test_every_run_family_takes_a_tracking_section(tmp_path, family, tag):
    """The run shell keeps the trackers of every family (engine/shell.py): an RL or vertical
    config's ``tracking:`` is not an unknown key, and its rows become scalars."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = {**family, "tracking": {"tensorboard": True}}
    fedloom.run(config, out=tmp_path / "run", progress=False)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars(tag)] == [1, 2]
