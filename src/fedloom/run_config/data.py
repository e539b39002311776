"""The ``data`` and ``model`` sections of a run config."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_serializer, model_validator

from fedloom.core.settings import StrictModel
from fedloom.data.config import validate
from fedloom.data.missing import MissingFeatures
from fedloom.errors import ConfigError, closest
from fedloom.models import MODELS


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
    options: dict[str, Any] = Field(default_factory=dict)
    """The model's own options, written flat in the section (``model: {name: resnet18, norm:
    group}``) and recorded there with their defaults filled in (docs/models.md)."""

    @model_validator(mode="before")
    @classmethod
    def _model_options(cls, value: Any) -> Any:
        """Move the keys besides ``name`` and ``freeze`` into ``options``."""
        if isinstance(value, dict):
            extra = {k: v for k, v in value.items() if k not in cls.model_fields}
            if extra:
                value = {k: v for k, v in value.items() if k in cls.model_fields}
                value["options"] = {**(value.get("options") or {}), **extra}
        return value

    @model_validator(mode="after")
    def _resolve_options(self) -> ModelConfig:
        """Check the options against the model's and fill in their defaults; a model that is
        not registered (a pretrained one, or a misspelt name, reported when the run builds
        it) takes none."""
        own = ["name", "freeze"]
        spec = MODELS.get(self.name) if self.name in MODELS else None
        fields = list(spec.options.model_fields) if spec is not None else []
        for key in self.options:
            if key not in fields:
                takers = [n for n in MODELS if key in MODELS.get(n).options.model_fields]
                hint = closest(key, own + fields)
                did = (
                    f" It is an option of {', '.join(takers)}."
                    if takers
                    else f" Did you mean 'model.{hint}'?"
                    if hint
                    else ""
                )
                raise ConfigError(
                    f"model.{key}: unknown key for model {self.name}.{did} "
                    f"Allowed here: {', '.join(own + fields)}."
                )
        if spec is not None:
            resolved = validate(spec.options, self.options, "model").model_dump(exclude_none=True)
            self.__dict__["options"] = resolved  # no second validation of the assignment
        return self

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        out = handler(self)
        out.update(out.pop("options", None) or {})
        return out
