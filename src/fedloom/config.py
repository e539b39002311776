"""The run configuration (DESIGN.md 3.4): pydantic models, strict keys, errors that name the key.

Every section forbids unknown keys. Algorithm-specific keys sit beside ``algorithm.name`` and
are validated by that algorithm's own config class; dataset-specific keys sit under a key named
after the dataset (``data: {name: synthetic, synthetic: {alpha: 1.0}}``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_serializer,
    model_validator,
)

from fedloom.errors import ConfigError, closest


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(StrictModel):
    name: str = "digits"
    root: str | None = None
    num_clients: int | None = Field(default=None, ge=1)
    partition: dict[str, Any] | None = None
    test_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)
    options: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _dataset_options(cls, value: Any) -> Any:
        """Move the sub-dict keyed by the dataset's name into ``options``."""
        if isinstance(value, dict):
            value = dict(value)
            name = value.get("name", "digits")
            if isinstance(name, str) and name in value and name not in cls.model_fields:
                opts = value.pop(name)
                if opts is not None and not isinstance(opts, dict):
                    raise ValueError(f"data.{name} must be a mapping of {name}'s options")
                value["options"] = opts or {}
        return value

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        options = out.pop("options", {})
        if options:
            out[self.name] = options
        return out


class ModelConfig(StrictModel):
    name: str = "mlp"


class TrainConfig(StrictModel):
    rounds: int = Field(default=20, ge=1)
    clients_per_round: int | None = Field(default=None, ge=1)
    local_epochs: int | None = Field(default=None, ge=1)
    local_steps: int | None = Field(default=None, ge=1)
    batch_size: int | None = Field(default=32, ge=1)
    lr: float = Field(default=0.05, gt=0.0)
    stragglers: float = Field(default=0.0, ge=0.0, lt=1.0)

    @model_validator(mode="after")
    def _one_budget(self) -> TrainConfig:
        if self.local_epochs is not None and self.local_steps is not None:
            raise ValueError(
                "set exactly one of train.local_epochs and train.local_steps, not both"
            )
        if self.local_epochs is None and self.local_steps is None:
            object.__setattr__(self, "local_epochs", 1)
        return self


class EvalConfig(StrictModel):
    every: int = Field(default=5, ge=1)
    new_clients: int = Field(default=0, ge=0)
    batch_size: int = Field(default=1024, ge=1)


class CheckpointConfig(StrictModel):
    every: int | None = Field(default=10, ge=1)
    keep: int = Field(default=2, ge=1)


class ExecutorConfig(StrictModel):
    kind: Literal["auto", "sequential", "vectorized", "ray"] = "auto"
    device: Literal["cpu", "cuda"] = "cpu"
    workers: int | None = Field(default=None, ge=1)
    threads: int | None = Field(default=None, ge=1)
    chunk_size: int | None = Field(default=None, ge=1)
    memory_budget: str | None = None
    address: str | None = None


class StateConfig(StrictModel):
    storage: Literal["memory", "mmap"] = "memory"
    """Per-client persistent state: stacked tensors in RAM, or memory-mapped files under the
    run directory's ``state/`` (for very many clients)."""


class RunConfig(StrictModel):
    seed: int = 0
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    algorithm: dict[str, Any] = Field(default_factory=lambda: {"name": "fedavg"})
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    executor: ExecutorConfig = Field(default_factory=ExecutorConfig)
    state: StateConfig = Field(default_factory=StateConfig)

    @model_validator(mode="after")
    def _algorithm_named(self) -> RunConfig:
        name = self.algorithm.get("name")
        if not isinstance(name, str):
            raise ValueError("algorithm.name is required (see `fedloom algorithms`)")
        return self

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


DEFAULT_EXPERIMENT: dict[str, Any] = {
    "seed": 0,
    "data": {"name": "digits", "num_clients": 30, "partition": {"kind": "dirichlet", "alpha": 0.3}},
    "model": {"name": "cnn"},
    "algorithm": {"name": "fedavg_ft", "finetune_steps": 10},
    "train": {
        "rounds": 100,
        "clients_per_round": 10,
        "local_epochs": 2,
        "batch_size": 16,
        "lr": 0.05,
    },
    "eval": {"every": 5},
    "checkpoint": {"every": 20},
}
"""``fedloom run`` without a file: scikit-learn's bundled digits, no download."""


def _field_names(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The valid key names at ``loc`` (for did-you-mean on unknown keys)."""
    current: Any = model
    for part in loc[:-1]:
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        current = fields[part].annotation
        current = next(
            (a for a in getattr(current, "__args__", ()) if hasattr(a, "model_fields")), current
        )
    return list(getattr(current, "model_fields", {}))


def format_validation_error(err: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """One line per problem, each naming the full key path, the value and what is allowed."""
    lines = []
    for e in err.errors():
        loc = tuple(e["loc"])
        key = prefix + ".".join(str(p) for p in loc) if loc else prefix.rstrip(".") or "config"
        if e["type"] == "extra_forbidden":
            hint = closest(str(loc[-1]), _field_names(model, loc))
            extra = (
                f" Did you mean '{prefix}{'.'.join(map(str, (*loc[:-1], hint)))}'?" if hint else ""
            )
            allowed = ", ".join(_field_names(model, loc))
            lines.append(f"{key}: unknown key.{extra} Allowed here: {allowed}.")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            value = e.get("input")
            shown = f" (got {value!r})" if not isinstance(value, dict) and value is not None else ""
            lines.append(f"{key}: {msg}{shown}")
    return "; ".join(lines)


def parse_config(raw: dict[str, Any]) -> RunConfig:
    """Validate a raw mapping into a RunConfig; raise ConfigError naming the key on failure."""
    if not isinstance(raw, dict):
        raise ConfigError(f"config: expected a mapping of sections, got {type(raw).__name__}")
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, RunConfig)) from None


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    return raw or {}


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``--set key.path=value`` overrides (values parsed as YAML scalars/lists)."""
    raw = yaml.safe_load(yaml.safe_dump(raw))  # deep copy of plain data
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {item!r}: expected key.path=value")
        path, text = item.split("=", 1)
        keys = [k for k in path.strip().split(".") if k]
        if not keys:
            raise ConfigError(f"--set {item!r}: empty key")
        node = raw
        for key in keys[:-1]:
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"--set {path}: '{key}' is not a section")
            node = child
        node[keys[-1]] = yaml.safe_load(text)
    return raw


def resolve_config(config: Any) -> RunConfig:
    """Accept a RunConfig, a mapping, or a YAML path."""
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, str | Path):
        return parse_config(load_yaml(config))
    if config is None:
        return parse_config(DEFAULT_EXPERIMENT)
    return parse_config(config)
