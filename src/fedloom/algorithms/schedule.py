"""Round schedules of a proximal coefficient (FedProx's and Ditto's mu, pFedMe's lambda).

A fedloom design rule (docs/cold_start.md, "Decaying the proximal coefficient"): mu may decay
over the communication rounds (strong alignment early stabilizes training, weak alignment late
leaves room to personalize), with the linear decay mu_t = mu_max (1 - t/T) + mu_min t/T or a
cosine annealing between mu_max ~ 1.0 and mu_min ~ 0.01. With s = (t - 1) / (T - 1) for round t =
1..T (so round 1 uses mu_max and round T uses mu_min exactly)::

    constant:  mu_t = mu_max
    linear:    mu_t = mu_max (1 - s) + mu_min s
    cosine:    mu_t = mu_min + (mu_max - mu_min) (1 + cos(pi s)) / 2

mu_max is the algorithm's own coefficient (``mu``, pFedMe's ``lam``).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field

from fedloom.core.settings import FrozenModel


class Schedule(FrozenModel):
    """``{kind: constant | linear | cosine, min: ...}``: how the coefficient decays over rounds."""

    kind: Literal["constant", "linear", "cosine"] = "constant"
    min: float = Field(default=0.01, ge=0.0, description="value in the last round (mu_min)")

    @property
    def constant(self) -> bool:
        return self.kind == "constant"

    def at(self, maximum: float, round: int, rounds: int) -> float:
        """The coefficient of round ``round`` (1-based) of ``rounds``, from ``maximum``."""
        if self.kind == "constant":
            return maximum
        s = min(1.0, max(0.0, (round - 1) / (rounds - 1))) if rounds > 1 else 1.0
        if self.kind == "linear":
            return maximum * (1.0 - s) + self.min * s
        return self.min + (maximum - self.min) * (1.0 + math.cos(math.pi * s)) / 2.0


def schedule_field(what: str) -> Schedule:
    """The ``*_schedule`` hyperparameter (default: constant)."""
    return Field(
        default=Schedule(), description=f"decay of {what} over rounds (docs/cold_start.md)"
    )
