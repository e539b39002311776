"""The base of every config section: strict keys, finite numbers, checked again on assignment."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field


class StrictModel(BaseModel):
    """A config section: unknown keys are errors, ``inf`` and ``nan`` are refused in every float
    field (naming the key), and assigned values are validated. Values are strict
    (docs/inputs.md, "Strict values"): a bool is not a number, a number or string not a bool, a
    quoted string not a number; an int is a float (``lr: 1``)."""

    model_config = ConfigDict(
        extra="forbid", allow_inf_nan=False, strict=True, validate_assignment=True
    )


def _list_as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value


LIST_AS_TUPLE = BeforeValidator(_list_as_tuple)
"""A tuple field's marker (``Annotated[tuple[float, float], LIST_AS_TUPLE]``): YAML writes a
tuple as a list, which strict mode would refuse; the items stay strict."""


Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
"""A run's ``seed``: what the random streams (core/rng.py) pack as a signed 64-bit integer."""


class FrozenModel(StrictModel):
    """A config section that never changes once parsed (an algorithm's hyperparameters, a
    dataset's options, a partition, a search distribution): :class:`StrictModel`'s rules, and
    frozen (hashable)."""

    model_config = ConfigDict(frozen=True)
