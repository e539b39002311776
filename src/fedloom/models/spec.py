"""What a registered model declares: how it is built and which ``model.*`` options it takes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from fedloom.core.settings import FrozenModel
from fedloom.models.base import FedModel


class NoOptions(FrozenModel):
    """Models without options: a key besides ``model.name`` is an error."""


@dataclass(frozen=True)
class ModelSpec:
    """A registered model: ``build(input_shape, num_outputs, **options)`` and the pydantic
    model of its options (the ``model`` section's keys besides ``name``: README.md, "A
    config"; docs/models.md)."""

    build: Callable[..., FedModel]
    options: type[BaseModel] = NoOptions

    def parse(self, options: dict[str, Any] | None) -> BaseModel:
        """The options, validated, with their defaults (pydantic's ValidationError if wrong)."""
        return self.options.model_validate(dict(options or {}))

    def resolved(self, options: dict[str, Any] | None) -> dict[str, Any]:
        """The options as ``build`` takes them and config.yaml records them: every default
        filled in, unset optional values (None) left out."""
        return self.parse(options).model_dump(exclude_none=True)
