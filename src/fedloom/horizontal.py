"""Horizontal federated learning in ``fedloom.run``'s registry of run families (api.py): its
config with the dataset's defaults resolved, the caller's data and model checked once
(docs/inputs.md, "What the Python API checks"), the engine built (engine/loop.py), and its
rounds run through the run shell (engine/shell.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from fedloom.config import RunConfig, load_yaml, parse_config, resolve_config
from fedloom.data import FederatedData, load_dataset, resolve_data_config
from fedloom.data.checks import check_data
from fedloom.data.partition_file import FILE_NAME as PARTITION_FILE
from fedloom.data.partition_file import write_partition_file
from fedloom.engine.build import check_model_fits
from fedloom.engine.loop import Engine, horizontal_timing
from fedloom.engine.rundir import RunDir
from fedloom.engine.shell import RunInputs, RunResult, RunShell, Timing
from fedloom.errors import ConfigError, clipped
from fedloom.models import MODELS
from fedloom.peft import build_run_model
from fedloom.serving import add_routing


def resolve_defaults(cfg: RunConfig, custom_data: bool = False) -> RunConfig:
    """The config with the registered dataset's defaults filled in (partition parameters,
    dataset options, client count; the algorithm's were filled in when it was parsed)."""
    if custom_data:
        return cfg
    raw = {**cfg.to_dict(), "algorithm": cfg.algorithm}  # parsed already: not again
    raw["data"].pop(cfg.data.name, None)
    raw["data"] |= resolve_data_config(cfg.data)
    return parse_config(raw)


def check_types(data: object, model: object) -> None:
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


class HorizontalFamily:
    """The run family of a ``RunConfig`` (README.md, "Python API")."""

    def check_inputs(self, inputs: RunInputs) -> None:
        check_types(inputs.data, inputs.model)

    def parse(self, config: Any, inputs: RunInputs) -> RunConfig:
        return resolve_defaults(resolve_config(config), custom_data=inputs.data is not None)

    def parse_saved(self, path: Path) -> RunConfig:
        return parse_config(load_yaml(path))

    def timing(self, cfg: RunConfig) -> Timing:
        return horizontal_timing(cfg)

    def runner(self, cfg: RunConfig, inputs: RunInputs) -> HorizontalRunner:
        return HorizontalRunner(cfg, inputs)


class HorizontalRunner:
    """A horizontal run's engine on the caller's or the configured data and model."""

    def __init__(self, cfg: RunConfig, inputs: RunInputs) -> None:
        model = inputs.model
        if model is None and cfg.peft is None:
            MODELS.get(cfg.model.name)  # an unknown model name before the data is loaded
        self.cfg, self.data = cfg, run_data(cfg, inputs.data)
        if model is not None:
            check_model_fits(model, self.data, cfg.model.name, user=True)
        # the config's model: with a peft section, a frozen pretrained transformer (docs/peft.md)
        module = (
            model
            if model is not None
            else build_run_model(cfg, self.data.input_shape, self.data.num_outputs)
        )
        self.engine = Engine(cfg, self.data, module, callbacks=inputs.callbacks)  # validates
        if inputs.executor is not None:
            self.engine.use_executor(inputs.executor(self.engine.model))

    @property
    def name(self) -> tuple[str, str]:
        return self.engine.name

    def save_inputs(self, run_dir: RunDir) -> None:
        """The partition (pooled datasets only) and the label histogram."""
        write_partition_file(run_dir.file(PARTITION_FILE), self.data)
        hist = self.data.label_histogram()
        if hist is not None:
            run_dir.write_json(
                "label_histogram.json", {"client_names": self.data.client_names, "counts": hist}
            )

    def run(self, shell: RunShell) -> RunResult:
        result = self.engine.run_in(shell)
        if self.cfg.serving.route != "none":  # the router's accuracy beside each model's
            add_routing(self.engine, result)
        return result


def run_data(cfg: RunConfig, data: FederatedData | None) -> FederatedData:
    """The configured dataset, or the caller's checked once (docs/inputs.md)."""
    if data is None:
        return load_dataset(cfg.data, cfg.seed)
    check_data(data, training_clients=data.num_clients - cfg.eval.new_clients)
    return data
