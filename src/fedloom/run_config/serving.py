"""The ``serving`` section of a run config (docs/serving.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedloom.core.settings import StrictModel


class ServingConfig(StrictModel):
    """Deployable copies and routing (docs/serving.md; engine/serving.py, serving/,
    docs/serving.md). Absent or all off: nothing is kept."""

    keep_best: bool = False
    """Keep the global model of the round with the best validation metric (and, when clients
    deploy models of their own, each client's best one); needs eval.validation_fraction."""
    ema: float | None = Field(default=None, gt=0.0, lt=1.0)
    """Decay of an exponential moving average of the global model, updated every round."""
    route: Literal["none", "confidence"] = "none"
    """confidence: per input, a client's personal model when its top softmax probability is
    at least ``threshold``, else the more confident of it and the global model."""
    threshold: float = Field(default=0.8, ge=0.0, le=1.0)

    @property
    def enabled(self) -> bool:
        return self.keep_best or self.ema is not None or self.route != "none"
