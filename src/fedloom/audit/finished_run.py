"""A finished run read back from its run directory: its config, the data its clients trained on
(rebuilt from the config and seed, or handed in for a run on custom data), the model, and from
the newest checkpoint the global model and each training client's deployed (personalized) model,
exactly as the run's own evaluation computes them (``Algorithm.deployed_model``)."""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import nn

from fedloom.config import RunConfig, load_yaml, parse_config
from fedloom.core.files import read_json_object
from fedloom.core.functional import FunctionalModel
from fedloom.core.pytree import Tree
from fedloom.core.run_files import Summary, read_typed
from fedloom.core.runpaths import under
from fedloom.data import FederatedData, load_dataset
from fedloom.engine.loop import Engine
from fedloom.engine.rundir import RunDir, refuse_if_written
from fedloom.engine.state import RunState
from fedloom.errors import ConfigError, RunDirError
from fedloom.peft import build_run_model
from fedloom.run_config.executor import ExecutorConfig

Model = tuple[Tree, Tree]
"""(params, buffers)."""


@dataclass
class FinishedRun:
    """What an audit needs of a run: the trained models and the data behind them."""

    path: Path
    config: RunConfig
    data: FederatedData
    """The data the clients trained on (a poisoning attack's malicious clients' as poisoned)."""
    source_data: FederatedData
    """The data as rebuilt or given, before any poisoning (its partition, its held-out splits)."""
    model: FunctionalModel
    engine: Engine
    round: int
    """The round of the checkpoint the models come from."""
    global_model: Model | None
    deployed: dict[int, Model]
    """Each training client's deployed model (held-out new clients are left out: they never
    trained, so they have no members)."""
    evaluation: dict[str, Any] = field(default_factory=dict)
    """The evaluation row of these models (global and per-client held-out accuracy)."""

    @property
    def train_ids(self) -> list[int]:
        return list(self.engine.train_ids)

    @property
    def summary(self) -> dict[str, Any]:
        path = under(self.path, "summary.json")
        return read_typed(path, Summary) if path.is_file() else {}


def load_finished_run(
    run_dir: str | Path, data: FederatedData | None = None, model: nn.Module | None = None
) -> FinishedRun:
    """Read ``run_dir`` back. ``data`` and ``model`` are the ones a run on custom data or a
    custom model was given (``fedloom.run(config, data=..., model=...)``); otherwise both are
    rebuilt from ``config.yaml`` (same dataset, partition and seed, so the same clients)."""
    run = RunDir.open_existing(run_dir)
    refuse_if_written(run.path, "audit")  # its checkpoints may be pruned while they are read
    cfg = parse_config(load_yaml(run.config_path))
    if data is None:
        data = load_dataset(cfg.data, cfg.seed)
    _check_same_data(run, data)
    module = (
        model
        if model is not None
        else build_run_model(cfg, data.input_shape, data.num_outputs)  # PEFT models too
    )
    # the models do not depend on where clients ran: read them back in this process
    cfg.executor = ExecutorConfig(kind="sequential")
    engine = Engine(cfg, data, module)
    saved = run.latest_checkpoint(engine.checkpoint_fit())
    if saved is None:
        raise RunDirError(
            f"{run.path} has no checkpoint to read the trained models from; run with "
            "checkpoint.every set (the last round is always checkpointed then)"
        )
    _check_same_model(saved, engine.model, run.path)
    state = RunState.from_checkpoint(saved, engine.new_store())
    if state.round != cfg.train.rounds:
        warnings.warn(
            f"{run.path} stopped at round {state.round} of {cfg.train.rounds}: auditing the "
            "models of its last checkpoint",
            UserWarning,
            stacklevel=2,
        )
    row, deployed = engine.evaluation.evaluate(engine.context(), state, state.round)
    keys = set(engine.model.param_keys)

    def split(tree: Tree) -> Model:
        return (
            {k: v for k, v in tree.items() if k in keys},
            {k: v for k, v in tree.items() if k not in keys},
        )

    return FinishedRun(
        path=run.path,
        config=cfg,
        data=engine.data,
        source_data=data,
        model=engine.model,
        engine=engine,
        round=state.round,
        global_model=engine.algorithm.global_model(state.server),
        deployed={c: split(deployed[c]) for c in engine.train_ids},
        evaluation=row,
    )


def _check_same_data(run: RunDir, data: FederatedData) -> None:
    """The data's per-client label counts against the run's label_histogram.json, so that an
    audit never scores one run's models on another dataset's clients."""
    path = run.file("label_histogram.json")
    if not path.is_file():
        return
    saved = read_json_object(path).get("counts")
    if saved is not None and saved != data.label_histogram():
        raise ConfigError(
            f"the data does not match the run in {run.path}: its clients' label counts differ "
            "from label_histogram.json (a run on custom data needs the same data= again)"
        )


def _check_same_model(saved: dict[str, Any], model: FunctionalModel, path: Path) -> None:
    server = saved.get("server", {})
    inner = server.get("inner", server)  # Ditto keeps its global algorithm's under 'inner'
    params = inner.get("params") if isinstance(inner, dict) else None
    if isinstance(params, dict) and params and not set(params) <= set(model.param_keys):
        raise ConfigError(
            f"the model does not match the checkpoint of {path}: it has parameters "
            f"{sorted(model.param_keys)}, the checkpoint {sorted(params)} (a run with a custom "
            "model needs the same model= again)"
        )
