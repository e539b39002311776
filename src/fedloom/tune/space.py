"""Search spaces: dotted config keys mapped to distributions (docs/tune.md).

```yaml
train.lr: {kind: float, low: 0.001, high: 1.0, log: true}
train.local_steps: {kind: int, low: 1, high: 20}
algorithm.name: {kind: categorical, choices: [fedavg, fedprox]}
```

Each key is a ``--set``-style path into the run config (``algorithm.mu``, ``data.partition.alpha``
...); a trial's values are applied to the base config exactly as ``--set`` overrides are
(``fedloom.config.apply_overrides``), so a categorical ``algorithm.name`` keeps the base config's
algorithm keys (each must be a key of every choice). Every key is checked against the config
before the first trial: a typo or a value the config rejects is a ``ConfigError`` naming the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, Self

import optuna
from pydantic import Discriminator, Field, ValidationError, model_validator

from fedloom.config import apply_overrides, load_yaml, parse_config
from fedloom.core.settings import FrozenModel, StrictModel
from fedloom.core.validation import format_validation_error
from fedloom.core.yaml_text import dump_yaml_text
from fedloom.errors import ConfigError, clipped

Scalar = bool | int | float | str | None


class _Dist(FrozenModel):
    """One search distribution of a space (docs/tune.md)."""


class _RangeDist(_Dist):
    """Base of the numeric distributions: a range [low, high], optionally in log space; its
    corners are the two ends."""

    kind: str
    low: float
    high: float
    log: bool = False

    @model_validator(mode="after")
    def _range(self) -> Self:
        _check_range(self.low, self.high, self.log, self.grid_step())
        return self

    def grid_step(self) -> float | None:
        """The spacing of a grid over the range, None for a continuous one."""
        raise NotImplementedError

    def corners(self) -> list[Scalar]:
        return [self.low, self.high]


class FloatDist(_RangeDist):
    """A real number in [low, high]; ``log``: uniform in log space; ``step``: a grid."""

    kind: Literal["float"]
    step: float | None = Field(default=None, gt=0)

    def grid_step(self) -> float | None:
        return self.step

    def suggest(self, trial: optuna.Trial, name: str) -> float:
        return trial.suggest_float(name, self.low, self.high, log=self.log, step=self.step)


class IntDist(_RangeDist):
    """An integer in [low, high] (both included)."""

    kind: Literal["int"]
    low: int
    high: int
    step: int = Field(default=1, ge=1)

    def grid_step(self) -> float | None:
        return None if self.step == 1 else self.step

    def suggest(self, trial: optuna.Trial, name: str) -> int:
        return trial.suggest_int(name, self.low, self.high, log=self.log, step=self.step)


class CategoricalDist(_Dist):
    """One of ``choices`` (numbers, strings, booleans or null)."""

    kind: Literal["categorical"]
    choices: list[Scalar] = Field(min_length=1)

    @model_validator(mode="after")
    def _distinct(self) -> CategoricalDist:
        if len({repr(c) for c in self.choices}) != len(self.choices):
            raise ValueError(f"choices must be distinct, got {self.choices}")
        return self

    def suggest(self, trial: optuna.Trial, name: str) -> Scalar:
        return trial.suggest_categorical(name, self.choices)

    def corners(self) -> list[Scalar]:
        return list(self.choices)


Distribution = Annotated[FloatDist | IntDist | CategoricalDist, Discriminator("kind")]


class _Space(StrictModel):
    params: dict[str, Distribution]


def _check_range(low: float, high: float, log: bool, step: float | None) -> None:
    if not low < high:
        raise ValueError(f"needs low < high, got low={low}, high={high}")
    if log and low <= 0:
        raise ValueError(f"log: true needs low > 0, got low={low}")
    if log and step is not None:
        raise ValueError("log: true and step exclude each other")


SearchSpace = dict[str, FloatDist | IntDist | CategoricalDist]
"""Dotted config key -> distribution, in the order the space file lists them."""


def parse_space(raw: Any, where: str = "space") -> SearchSpace:
    """Validate a mapping of dotted keys to distributions (errors name the key)."""
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(
            f"{where}: expected a mapping of dotted config keys to distributions, e.g. "
            "'train.lr: {kind: float, low: 0.001, high: 1.0, log: true}'"
        )
    for key, dist in raw.items():
        if not isinstance(key, str) or not key or any(not k for k in key.split(".")):
            raise ConfigError(
                f"{where}: {clipped(repr(key))} is not a dotted config key (train.lr)"
            )
        if not isinstance(dist, dict) or dist.get("kind") not in ("float", "int", "categorical"):
            raise ConfigError(
                f"{where}: {key}: expected a mapping with kind: float | int | categorical, "
                f"got {clipped(repr(dist))}"
            )
    try:
        parsed = _Space.model_validate({"params": raw})
    except ValidationError as err:
        message = format_validation_error(err, _Space)
        raise ConfigError(f"{where}: " + message.replace("params.", "")) from None
    return dict(parsed.params)


def load_space(path: str | Path) -> SearchSpace:
    """A search space from a YAML file (the ``--space`` of ``fedloom tune``)."""
    empty = "empty search space: give dotted config keys with distributions (docs/tune.md)"
    return parse_space(load_yaml(path, empty), where=str(path))


def override_items(params: dict[str, Scalar]) -> list[str]:
    """A trial's values as ``--set`` items (values written as YAML flow scalars)."""
    return [
        f"{k}={dump_yaml_text(v, default_flow_style=True).strip().removesuffix('...').strip()}"
        for k, v in params.items()
    ]


def apply_params(raw: dict[str, Any], params: dict[str, Scalar]) -> dict[str, Any]:
    """The base config (raw mapping) with a trial's values set at their dotted keys."""
    return apply_overrides(raw, override_items(params))


def check_space(raw: dict[str, Any], space: SearchSpace) -> None:
    """Every key of ``space`` set to each of its corner values (low, high, every choice), the
    others at their first corner, must give a valid config; else ``ConfigError`` naming the key.

    Catches typos (``train.lrr``: did you mean train.lr) and values the config rejects
    (``train.lr`` with low 0) before any trial runs."""
    base = {k: d.corners()[0] for k, d in space.items()}
    for key, dist in space.items():
        for value in dist.corners():
            try:
                parse_config(apply_params(raw, {**base, key: value}))
            except ConfigError as err:
                raise ConfigError(f"search space key {key} = {value!r}: {err}") from None


def suggest(trial: optuna.Trial, space: SearchSpace) -> dict[str, Scalar]:
    """The trial's values, one per key, drawn by the study's sampler."""
    return {key: dist.suggest(trial, key) for key, dist in space.items()}
