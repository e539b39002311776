"""Validation errors as one line per problem, each naming the full key path (``train.lr``,
``algorithm.mu``), the value and what is allowed: the message every config error shows."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from fedloom.errors import closest

_UNION_TAGS = {"count", "distribution"}
"""Branch tags pydantic puts into error locations; not keys, so dropped from messages."""


def _field_names(model: type[BaseModel], loc: tuple[Any, ...]) -> list[str]:
    """The valid key names at ``loc`` (for did-you-mean on unknown keys)."""
    current: Any = model
    for part in loc[:-1]:
        fields = getattr(current, "model_fields", None)
        if not fields or part not in fields:
            return []
        current = _model_in(fields[part].annotation) or current
    return list(getattr(current, "model_fields", {}))


def _model_in(annotation: Any) -> Any:
    """The first pydantic model inside an annotation (through unions and Annotated)."""
    if hasattr(annotation, "model_fields"):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def format_validation_error(err: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """One line per problem, each naming the full key path, the value and what is allowed."""
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"] if p not in _UNION_TAGS)
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
