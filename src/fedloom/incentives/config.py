"""The ``contribution`` and ``incentive`` sections of a run config (docs/incentives.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from fedloom.core.settings import StrictModel

EXACT_SHAPLEY_MAX = 12
"""contribution.kind exact: the most clients a round (2^12 coalition models)."""


class ContributionConfig(StrictModel):
    """Each round's clients valued by their contribution to the global model (docs/incentives.md;
    incentives/shapley.py): v(S) is the validation metric of the model the algorithm's server
    step builds from coalition S's uploads (v(empty): the model before the round).

    - ``exact``: Shapley values over all 2^n coalitions (n <= 12 clients a round);
    - ``loo``: leave-one-out, v(N) - v(N minus i);
    - ``tmc``: truncated Monte-Carlo Shapley (Ghorbani & Zou 2019);
    - ``gtg``: GTG-Shapley (Liu et al. 2022): guided, truncated, rescaled to the round's gain."""

    kind: Literal["none", "exact", "loo", "tmc", "gtg"] = "none"
    every: int = Field(default=1, ge=1)
    """Value the clients every this many rounds (rounds between reuse each client's latest)."""
    validation_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    """The held-out validation split v(S) is measured on (eval.validation_fraction's split:
    the larger of the two is held out)."""
    metric: Literal["loss", "accuracy"] = "loss"
    """v(S): minus the mean validation loss, or the validation accuracy (classification).
    The loss is continuous: truncation and rankings need it (docs/incentives.md, measured)."""
    tolerance: float = Field(default=1e-3, ge=0.0)
    """tmc, gtg: a permutation's walk stops once |v(N) - v(prefix)| < tolerance; gtg: a round
    whose gain |v(N) - v(empty)| is at most this values everyone 0."""
    max_permutations: int | None = Field(default=None, ge=1)
    """tmc, gtg: the most permutations a round (null: min(2^n, max(30, n, 0.8 x 2^n)))."""


class CostConfig(StrictModel):
    """A client's reported cost for a round it takes part in (incentives/costs.py)."""

    per_sample: float = Field(default=0.001, ge=0.0)
    """Per training sample processed (local steps x batch)."""
    per_mb: float = Field(default=0.01, ge=0.0)
    """Per MB (10^6 bytes) uploaded."""
    per_client: list[float] | None = None
    """User-given: client i's cost per round (replaces per_sample and per_mb)."""

    @field_validator("per_client")
    @classmethod
    def _non_negative(cls, costs: list[float] | None) -> list[float] | None:
        if costs is not None and any(c < 0 for c in costs):
            raise ValueError("costs must be >= 0")
        return costs


class IncentiveConfig(StrictModel):
    """Per-round payments from a budget to the round's clients (docs/incentives.md): FLI (Yu et
    al. 2020) and the baselines (equal split, by sample count, Shapley-proportional, cost
    only), all computed side by side on the same budget; ``kind`` is the headline scheme."""

    kind: Literal["none", "fli", "equal", "samples", "shapley", "cost"] = "none"
    budget: float = Field(default=100.0, gt=0.0)
    """B(t): the budget paid out every round."""
    omega: float = Field(default=1.0, ge=0.0)
    """FLI's weight of contribution against the regret and waiting queues (fairness)."""
    sub_rounds: int = Field(default=20, ge=1)
    """R: each round's budget is paid in R equal parts, the queues updated after each."""
    cost: CostConfig = Field(default_factory=CostConfig)
