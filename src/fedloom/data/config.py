"""Validate ``data.*`` config mappings with pydantic and report errors by their full key path."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from fedloom.errors import ConfigError, clipped, closest

M = TypeVar("M", bound=BaseModel)

_BOUNDS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def _describe(err: Mapping[str, Any], model: type[BaseModel], key: str) -> str:
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind == "extra_forbidden":
        field = key.rsplit(".", 1)[-1]
        valid = sorted(model.model_fields)
        hint = closest(field, valid)
        did_you_mean = f", did you mean '{hint}'?" if hint else ""
        return f"{key}: unknown key{did_you_mean} (valid keys: {', '.join(valid)})"
    if kind == "missing":
        return f"{key}: required key is missing"
    if kind in _BOUNDS:
        name, op = _BOUNDS[kind]
        bound = ctx[name]
        if isinstance(bound, float) and bound.is_integer():
            bound = int(bound)
        return f"{key}: must be {op} {bound}, got {clipped(repr(err['input']))}"
    msg = str(err["msg"])
    if kind == "value_error":
        return f"{key}: {msg.removeprefix('Value error, ')}"
    msg = msg[:1].lower() + msg[1:]
    return f"{key}: {msg}, got {clipped(repr(err.get('input')))}"


def validate(model: type[M], data: Mapping[str, Any] | None, prefix: str) -> M:
    """Build ``model`` from ``data``; any problem is a ConfigError naming ``prefix.key``."""
    if data is None:
        data = {}
    if isinstance(data, BaseModel):
        data = data.model_dump()
    if not isinstance(data, Mapping):
        raise ConfigError(
            f"{prefix}: must be a mapping, got {type(data).__name__} {clipped(repr(data))}"
        )
    try:
        return model.model_validate(dict(data))
    except ValidationError as exc:
        messages = []
        for err in exc.errors():
            loc = ".".join(str(part) for part in err["loc"])
            key = f"{prefix}.{loc}" if loc else prefix
            messages.append(_describe(err, model, key))
        raise ConfigError("; ".join(messages)) from None
