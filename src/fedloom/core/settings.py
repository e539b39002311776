"""The base of every config section: strict keys, finite numbers, checked again on assignment."""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field


class StrictModel(BaseModel):
    """A config section: unknown keys are errors, ``inf`` and ``nan`` are refused in every float
    field (naming the key), and assigned values are validated."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, validate_assignment=True)


Seed = Annotated[int, Field(ge=0, le=2**63 - 1)]
"""A run's ``seed``: what the random streams (core/rng.py) pack as a signed 64-bit integer."""
