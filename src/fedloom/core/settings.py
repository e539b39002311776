"""The base of every config section: strict keys, checked again on assignment."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class StrictModel(BaseModel):
    """A config section: unknown keys are errors, and assigned values are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)
