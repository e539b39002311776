"""The Python API (README.md, "Python API"): ``fedloom.run(config, data=None, model=None)``."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch import nn

from fedloom.audit.auditor import audit
from fedloom.config import RunConfig, load_yaml, parse_config, resolve_config
from fedloom.core.functional import FunctionalModel
from fedloom.data import FederatedData, load_dataset, resolve_data_config
from fedloom.data.checks import check_data
from fedloom.data.partition_file import FILE_NAME as PARTITION_FILE
from fedloom.data.partition_file import write_partition_file
from fedloom.engine.build import check_model_fits
from fedloom.engine.callbacks import Callback
from fedloom.engine.executor import Executor
from fedloom.engine.loop import Engine, RunResult
from fedloom.engine.rundir import RunDir, default_run_dir, differing_keys, releasing_locks
from fedloom.errors import ConfigError, RunDirError, clipped
from fedloom.models import MODELS
from fedloom.peft import build_run_model


def _save_inputs(run_dir: RunDir, config: RunConfig, data: FederatedData) -> None:
    run_dir.write_config(config.to_yaml())
    write_partition_file(run_dir.file(PARTITION_FILE), data)  # pooled datasets only
    hist = data.label_histogram()
    if hist is not None:
        run_dir.write_json(
            "label_histogram.json", {"client_names": data.client_names, "counts": hist}
        )


def resolve_defaults(cfg: RunConfig, custom_data: bool = False) -> RunConfig:
    """The config with the registered dataset's defaults filled in (partition parameters,
    dataset options, client count; the algorithm's were filled in when it was parsed)."""
    if custom_data:
        return cfg
    raw = {**cfg.to_dict(), "algorithm": cfg.algorithm}  # parsed already: not again
    raw["data"].pop(cfg.data.name, None)
    raw["data"] |= resolve_data_config(cfg.data)
    return parse_config(raw)


def _check_resume(run_dir: RunDir, config: RunConfig | None) -> RunConfig:
    saved = parse_config(load_yaml(run_dir.config_path))
    if config is not None:
        config = resolve_defaults(config)
    if config is not None and config.to_dict() != saved.to_dict():
        diff = differing_keys(saved.to_dict(), config.to_dict())
        raise RunDirError(
            f"cannot resume {run_dir.path}: its config.yaml differs from the given config at "
            f"{', '.join(diff)}; resume without a config (and without --set), or start a new "
            "run"
        )
    return saved


RUN_KINDS = ("horizontal", "rl", "vertical")


def run_kind(config: Any) -> str:
    """The run family of a config (path, mapping or parsed): its top-level ``kind:``
    (horizontal, rl or vertical). Without one it is inferred here, and only here, from the
    names a config of that family uses: an RL environment or algorithm, a vertical algorithm
    or partition (docs/rl.md and docs/vertical.md, "The kind key")."""
    from fedloom.rl.config import RLRunConfig, is_rl_config
    from fedloom.vertical.config import VerticalRunConfig, is_vertical_config

    if config is None or isinstance(config, RunConfig):
        return "horizontal"
    if isinstance(config, RLRunConfig | VerticalRunConfig):
        return config.kind
    raw = load_yaml(config) if isinstance(config, str | Path) else config
    kind = raw.get("kind") if isinstance(raw, dict) else None
    if kind is not None and kind not in RUN_KINDS:
        raise ConfigError(f"kind: expected one of {', '.join(RUN_KINDS)}, got {kind!r}")
    if kind is not None:
        return kind
    return "rl" if is_rl_config(raw) else "vertical" if is_vertical_config(raw) else "horizontal"


def _check_path(name: str, value: object) -> None:
    """ConfigError unless ``value`` (``out``, ``resume``) is None or a path."""
    if value is not None and not isinstance(value, str | os.PathLike):
        raise ConfigError(
            f"{name}: expected a directory path (str or pathlib.Path), got {type(value).__name__}"
        )


def _check_types(data: object, model: object) -> None:
    """ConfigError when ``data`` or ``model`` is not what a horizontal run takes (a model's
    name is a config key, a list of arrays goes through ``from_arrays``)."""
    if data is not None and not isinstance(data, FederatedData):
        raise ConfigError(
            f"data: expected a FederatedData, got {type(data).__name__}; build one with "
            "fedloom.data.from_arrays([(features, labels), ...]) or leave it out for the "
            "config's dataset"
        )
    if model is not None and not isinstance(model, nn.Module):
        hint = (
            f" (a name: set model.name: {clipped(model)} in the config)"
            if isinstance(model, str)
            else ""
        )
        raise ConfigError(
            f"model: expected a torch.nn.Module, got {type(model).__name__}{hint}; or leave it "
            "out for the config's model"
        )


def _with_report(result: RunResult) -> RunResult:
    if result.run_dir is not None:
        from fedloom.report import write_report

        write_report(result.run_dir.path)
    return result


@releasing_locks()  # the run directory's lock ends with the call, whatever its end
def run(
    config: RunConfig | dict[str, Any] | str | Path | None = None,
    *,
    data: FederatedData | None = None,
    model: nn.Module | None = None,
    out: str | Path | None = None,
    resume: str | Path | None = None,
    accept_config_change: bool = False,
    progress: bool | None = None,
    write: bool = True,
    executor: Callable[[FunctionalModel], Executor] | None = None,
    callbacks: list[Callback] | None = None,
) -> RunResult:
    """Run one experiment and return its summary, history and models.

    ``config`` is a path, a dict or a RunConfig (None: the embedded default). ``data`` and
    ``model`` replace the configured dataset and model. ``out`` is the run directory (default
    ``runs/<algorithm>-<dataset>-<time>``); ``resume`` continues a run directory from its last
    checkpoint, refusing one whose config.yaml changed since that checkpoint was written unless
    ``accept_config_change``. The run directory is locked for this call: a second run of it
    (``out`` or ``resume``), here or in another process, raises ``fedloom.errors.RunDirLocked``
    (the CLI's exit 2) naming the writer's PID. ``write=False`` keeps everything in memory.
    ``executor(model)`` makes the executor instead of the config (the Flower adapter's, which
    sends clients' work to nodes). ``callbacks`` run around the round loop
    (engine/callbacks.py; ``fedloom tune``'s reporter).
    """
    _check_path("out", out)
    _check_path("resume", resume)
    # a run directory to resume is checked (no symbolic link in it) before its config is read
    saved = RunDir.open_existing(resume).config_path if resume is not None else None
    kind = run_kind(config if saved is None else saved)
    if kind == "rl":  # federated RL (docs/rl.md)
        from fedloom.rl.run import run_rl

        if data is not None or model is not None:
            raise ConfigError("an RL run takes neither data nor model (docs/rl.md)")
        return _with_report(
            run_rl(
                config,
                out=out,
                write=write,
                resume=resume,
                accept_config_change=accept_config_change,
            )
        )
    if kind == "vertical":  # vertical and transfer FL (docs/vertical.md)
        from fedloom.vertical.run import run_vertical

        if model is not None:
            raise ConfigError("a vertical run takes no model (docs/vertical.md)")
        result = run_vertical(
            config,
            out=out,
            write=write,
            data=data,
            resume=resume,
            accept_config_change=accept_config_change,
        )
        return _with_report(result)
    _check_types(data, model)
    run_dir: RunDir | None = None
    if resume is not None:
        run_dir = RunDir.open_for_writing(resume, accept_config_change)
        cfg = _check_resume(run_dir, None if config is None else resolve_config(config))
        run_dir.config = cfg.to_dict()
    else:
        if out is not None and write:
            RunDir.check_new(out)  # before the data is loaded (RunDir.create locks it later)
        cfg = resolve_defaults(resolve_config(config), custom_data=data is not None)
    if model is None and cfg.peft is None:
        MODELS.get(cfg.model.name)
    if data is None:
        data = load_dataset(cfg.data, cfg.seed)
    else:  # the caller's: checked once, here (docs/inputs.md, "What the Python API checks")
        check_data(data, training_clients=data.num_clients - cfg.eval.new_clients)
    if model is not None:
        check_model_fits(model, data, cfg.model.name, user=True)
    # the config's model: with a peft section, a frozen pretrained transformer (docs/peft.md)
    module = (
        model if model is not None else build_run_model(cfg, data.input_shape, data.num_outputs)
    )
    if progress is None:
        progress = sys.stderr.isatty()
    engine = Engine(  # validates first
        cfg, data, module, run_dir=run_dir, progress=progress, callbacks=callbacks
    )
    if executor is not None:
        engine.use_executor(executor(engine.model))
    if resume is None and write:
        run_dir = engine.run_dir = RunDir.create(
            out or default_run_dir(cfg.algorithm.name, data.name)
        )
        _save_inputs(run_dir, cfg, data)
    result = engine.run(resume=resume is not None)
    if cfg.serving.route != "none":  # the router's accuracy beside each model's (serving/)
        from fedloom.serving import add_routing

        add_routing(engine, result)
    if run_dir is not None:
        run_dir.write_json("summary.json", result.summary)
        from fedloom.report import write_report

        write_report(run_dir.path)
    return result


__all__ = ["ConfigError", "RunResult", "audit", "run"]
