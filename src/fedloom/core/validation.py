"""Validation errors as one line per problem, each naming the full key path (``train.lr``,
``algorithm.mu``), the value and what is allowed: the message every config error shows."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from fedloom.errors import SHOWN_CHARS, ConfigError, FedloomInputError, clipped, closest

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


SHOWN_PROBLEMS = 5
"""The most problems one error line lists (a list of 100,000 wrong items has as many)."""


def format_validation_error(err: ValidationError, model: type[BaseModel], prefix: str = "") -> str:
    """One line per problem (the first ``SHOWN_PROBLEMS``), each naming the full key path, the
    value and what is allowed."""
    lines = []
    errors = err.errors()
    for e in errors[:SHOWN_PROBLEMS]:
        loc = tuple(p for p in e["loc"] if p not in _UNION_TAGS)
        key = prefix + ".".join(str(p) for p in loc) if loc else prefix.rstrip(".") or "config"
        key = clipped(key)  # a key of 100 KB is named, not echoed
        if e["type"] == "extra_forbidden":
            hint = closest(str(loc[-1]), _field_names(model, loc))
            extra = (
                f" Did you mean '{prefix}{'.'.join(map(str, (*loc[:-1], hint)))}'?" if hint else ""
            )
            allowed = ", ".join(_field_names(model, loc))
            lines.append(f"{key}: unknown key.{extra} Allowed here: {allowed}.")
        else:
            msg = clipped(e["msg"].removeprefix("Value error, "), 4 * SHOWN_CHARS)
            value = e.get("input")
            shown = (
                f" (got {clipped(repr(value))})"
                if not isinstance(value, dict) and value is not None
                else ""
            )
            lines.append(f"{key}: {msg}{shown}")
    if len(errors) > SHOWN_PROBLEMS:
        lines.append(f"and {len(errors) - SHOWN_PROBLEMS:,} more")
    return "; ".join(lines)


INT64_MAX = 2**63 - 1


def check_int64(raw: Any, prefix: str = "") -> None:
    """ConfigError naming the first integer of a raw config that does not fit a signed 64-bit
    integer (``train.rounds: 10**21`` would overflow a tensor, or run for ever)."""
    if isinstance(raw, dict):
        for key, value in raw.items():
            check_int64(value, f"{prefix}{key}.")
    elif isinstance(raw, list):
        for value in raw:
            check_int64(value, prefix)
    elif isinstance(raw, int) and not isinstance(raw, bool) and abs(raw) > INT64_MAX:
        # str() of an int over 4300 digits is a ValueError (sys.get_int_max_str_digits)
        text = clipped(str(raw)) if raw.bit_length() <= 14_000 else f"{raw.bit_length():,} bits"
        raise ConfigError(f"{clipped(prefix.rstrip('.'))}: {text} is too large (at most 2^63 - 1)")


MAX_CONFIG_NODES = 100_000
"""The most values a config may expand to (YAML aliases repeat a node wherever they point)."""


def check_plain_tree(value: Any, where: str, error: type[FedloomInputError] = ConfigError) -> None:
    """``error`` (a ConfigError) when YAML aliases make ``value`` refer to itself
    (``&a [*a]``) or expand past ``MAX_CONFIG_NODES`` values (an alias bomb): either would
    exhaust recursion or memory."""
    seen = 0
    stack: list[tuple[Any, frozenset[int]]] = [(value, frozenset())]
    while stack:
        node, path = stack.pop()
        seen += 1
        if seen > MAX_CONFIG_NODES:
            raise error(f"{where}: expands to more than {MAX_CONFIG_NODES:,} values")
        if isinstance(node, dict | list):
            if id(node) in path:
                raise error(f"{where}: a YAML alias refers to the value that holds it")
            children = node.values() if isinstance(node, dict) else node
            stack.extend((child, path | {id(node)}) for child in children)
