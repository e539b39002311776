"""Each participant's reported cost c_i(t) of a round (FLI, Yu et al. 2020) from a declared
cost model: compute, per training sample processed, plus communication, per MB uploaded; or a
cost the user gives per client (``incentive.cost.per_client``), charged every round it takes
part."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MB = 1e6
"""Bytes in a MB (decimal, as the run's byte counts are reported)."""


@dataclass(frozen=True)
class CostModel:
    """c_i(t) = per_sample * samples processed + per_mb * MB uploaded, or ``per_client[i]``
    when given (indexed by client id)."""

    per_sample: float = 0.001
    per_mb: float = 0.01
    per_client: Sequence[float] | None = None

    def cost(self, client: int, samples: int, bytes_up: int) -> float:
        if self.per_client is not None:
            return float(self.per_client[client])
        return self.per_sample * samples + self.per_mb * bytes_up / MB
