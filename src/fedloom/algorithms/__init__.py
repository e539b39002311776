"""Algorithms by name. One module per algorithm: ``fedloom/algorithms/<name>.py``."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from pydantic import ValidationError

from fedloom.algorithms.base import ALGORITHMS, Algorithm, AlgorithmConfig, AlgorithmContext
from fedloom.core.protocol import ClientResult, ClientTask
from fedloom.core.validation import format_validation_error
from fedloom.errors import ConfigError


def _import_every_algorithm() -> None:
    """Import each module of this package: defining an algorithm class registers it."""
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


_import_every_algorithm()


def parse_algorithm_config(raw: dict[str, Any]) -> AlgorithmConfig:
    """Validate ``algorithm:`` keys with the named algorithm's Config; errors name the key."""
    cls = ALGORITHMS.get(str(raw.get("name")))
    try:
        return cls.Config.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(format_validation_error(err, cls.Config, prefix="algorithm.")) from None


def build_algorithm(config: AlgorithmConfig | dict[str, Any], ctx: AlgorithmContext) -> Algorithm:
    """The algorithm of ``config``: a parsed Config (a RunConfig's ``algorithm``) or raw keys."""
    if not isinstance(config, AlgorithmConfig):
        config = parse_algorithm_config(config)
    return ALGORITHMS.get(config.name)(config, ctx)


def describe(cls: type[Algorithm]) -> str:
    """One line: name, summary and hyperparameters with defaults."""
    fields = [f"{k}={f.default!r}" for k, f in cls.Config.model_fields.items() if k != "name"]
    params = f" [{', '.join(fields)}]" if fields else ""
    return f"{cls.name:<12} {cls.summary}{params}"


__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "AlgorithmConfig",
    "AlgorithmContext",
    "ClientResult",
    "ClientTask",
    "build_algorithm",
    "describe",
    "parse_algorithm_config",
]
