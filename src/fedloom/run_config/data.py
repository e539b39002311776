"""The ``data`` and ``model`` sections of a run config."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_serializer, model_validator

from fedloom.core.settings import StrictModel
from fedloom.data.missing import MissingFeatures


class DataConfig(StrictModel):
    name: str = "digits"
    root: str | None = None
    num_clients: int | None = Field(default=None, ge=1)
    partition: dict[str, Any] | None = None
    test_fraction: float = Field(default=0.2, gt=0.0, lt=1.0)
    missing: MissingFeatures | None = None
    """Clients lacking input features: {kind: columns | regions, fraction, clients}
    (data/missing.py, docs/missing_features.md)."""
    max_length: int | None = Field(default=None, ge=1)
    """Text datasets (bbc_news): tokens per sample, padded or truncated (default 32)."""
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
    freeze: bool = True
    """Pretrained models (minilm, tiny_bert): the backbone stays frozen; only the ``peft``
    parameters and the head train (docs/peft.md)."""
