"""The engine's aggregation slot with a robust rule (``aggregator.kind``).

Each call gets the clients' trees (their models, or whatever tree the algorithm averages) and
their weights. The rules work on updates: a tree minus the round's broadcast tree with the same
keys (the model), or the tree itself when nothing was broadcast under those keys (SCAFFOLD's
control-variate deltas). The rows are stacked in float64, the rule picks or combines them, and
the broadcast tree is added back. Median, trimmed mean, Krum, Multi-Krum and Bulyan ignore the
weights (each client counts once, as in their papers); norm clipping keeps FedAvg's weighted
mean of the clipped updates.

A round with fewer clients than a rule's precondition (after dropouts or dropped stragglers)
is skipped: the model stays as it was and the skip is counted. With the nominal number of
clients per round the preconditions are checked when the config is parsed.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from fedloom.core.mechanism import Aggregator, Mechanism, UpdateSum
from fedloom.core.pytree import flatten64, unflatten
from fedloom.core.rng import generator
from fedloom.errors import ConfigError, RoundAborted
from fedloom.robust import rules

if TYPE_CHECKING:
    from fedloom.robust.config import AggregatorConfig

Tree = dict[str, torch.Tensor]


class RobustAggregation(Mechanism):
    """One run's robust aggregation rule (core/mechanism.py): ``start_round``, then
    ``aggregate`` in place of the mean (the algorithm's ``ctx.aggregate``)."""

    key = "robust"
    section = "aggregator"

    def __init__(self, config: AggregatorConfig, seed: int, f: int) -> None:
        self.config = config
        self.seed = seed
        self.f = f
        """The number of Byzantine clients the rule tolerates (``aggregator.f``, or the attack's
        expected number per round)."""
        self.round = 0
        self.sent: Mapping[str, Any] = {}
        self.rounds_skipped = 0

    def start_round(self, round: int, message: Mapping[str, Any]) -> None:
        self.round = round
        self.sent = message

    def wrap_aggregate(self, inner: Aggregator, update_sum: UpdateSum | None) -> Aggregator:
        return self.aggregate

    def aggregate(self, trees: Sequence[Tree], weights: Sequence[float]) -> Tree:
        keys = list(trees[0])
        anchor = self._anchor(keys)
        base = flatten64(anchor, keys) if anchor is not None else None
        rows = torch.stack([flatten64(t, keys) for t in trees])
        if base is not None:
            rows = rows - base
        try:
            combined = self.combine(rows, weights)
        except ConfigError as err:  # a precondition this round's clients do not meet
            self.rounds_skipped += 1
            raise RoundAborted(str(err)) from None
        if base is not None:
            combined = combined + base
        return unflatten(combined, trees[0], keys)

    def combine(self, rows: torch.Tensor, weights: Sequence[float]) -> torch.Tensor:
        """The rule on the stacked updates."""
        cfg, f = self.config, self.f
        kind = cfg.kind
        if kind == "median":
            return rules.coordinate_median(rows)
        if kind == "trimmed_mean":
            return rules.trimmed_mean(rows, cfg.beta)
        if kind == "krum":
            return rules.multi_krum(rows, f, m=1)
        if kind == "multi_krum":
            return rules.multi_krum(rows, f, m=cfg.m)
        if kind == "bulyan":
            return rules.bulyan(rows, f)
        if kind == "norm_clip":
            bound = cfg.max_norm if cfg.max_norm is not None else rules.median_norm(rows)
            clipped = rules.clip_rows(rows, bound)
            w = torch.tensor(list(weights), dtype=rows.dtype)
            mean = (w[:, None] * clipped).sum(dim=0) / w.sum()
            if cfg.noise > 0:
                gen = generator(self.seed, "robust/noise", self.round)
                noise = torch.randn(mean.shape, generator=gen, dtype=torch.float64)
                mean = mean + cfg.noise * noise
            return mean
        raise ValueError(f"no robust rule {kind!r}")

    def _anchor(self, keys: list[str]) -> Mapping[str, torch.Tensor] | None:
        for value in self.sent.values():
            if isinstance(value, Mapping) and value and set(value) == set(keys):
                return value
        return None

    def summary(self) -> dict[str, Any]:
        return {"kind": self.config.kind, "f": self.f, "rounds_skipped": self.rounds_skipped}

    def state_dict(self) -> dict[str, Any]:
        return {"rounds_skipped": self.rounds_skipped}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.rounds_skipped = int(saved.get("rounds_skipped", 0))
