"""The ``attack`` section of a run config (docs/security.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedloom.core.settings import StrictModel


class TriggerConfig(StrictModel):
    size: int = Field(default=3, ge=1)
    """Side of the square trigger in pixels (flat inputs: size^2 last features)."""
    value: float | None = None
    """The trigger's pixel value (null: the largest input value of the training data)."""


class AttackConfig(StrictModel):
    """Poisoning by a seeded fraction of malicious clients (docs/security.md)."""

    kind: Literal[
        "none", "label_flip", "random_labels", "backdoor", "gaussian", "scale", "sign_flip"
    ] = "none"
    fraction: float = Field(default=0.2, ge=0.0, lt=1.0)
    """Of all training clients, chosen once with the run's seed."""
    mode: Literal["complement", "all_to_one", "targeted"] = "complement"
    """label_flip: y -> C - 1 - y, y -> target, or source -> target."""
    source: int | None = Field(default=None, ge=0)
    """label_flip mode targeted: the class relabelled."""
    target: int = Field(default=0, ge=0)
    """label_flip (all_to_one, targeted) and backdoor: the label the attacker wants."""
    scale: float | None = Field(default=None, gt=0.0)
    """scale: the boost K (null: the clients per round); sign_flip: s >= 1 (null: 1)."""
    trigger: TriggerConfig = Field(default_factory=TriggerConfig)
    """backdoor: the pixel trigger."""
    poison_fraction: float = Field(default=0.5, gt=0.0, le=1.0)
    """backdoor: the fraction of a malicious client's samples stamped and relabelled."""

    @model_validator(mode="after")
    def _complete(self) -> AttackConfig:
        if self.kind == "label_flip" and self.mode == "targeted" and self.source is None:
            raise ValueError("label_flip mode targeted needs source (the class to relabel)")
        if self.kind == "sign_flip" and self.scale is not None and self.scale < 1:
            raise ValueError(f"sign_flip scale s must be >= 1, got {self.scale}")
        return self
