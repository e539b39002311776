"""Client weights, the one place they are defined. Every algorithm with a choice of client
weights has the hyperparameter ``weighting``:

- ``samples``: client k weighs n_k, its number of training samples (FedAvg's objective
  sum_k (n_k / n) F_k);
- ``uniform``: every client weighs the same (the objective 1/K sum_k F_k of SCAFFOLD, FedDyn,
  pFedMe, APFL and Per-FedAvg's papers).

Two scales of the same weights: ``aggregation_weight`` (n_k or 1), for weighted averages,
which normalize; ``objective_weight`` (p_k = n_k / n or 1/K), where the value itself enters an
update (FedDyn's and SCAFFOLD's corrections)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field

Weighting = Literal["uniform", "samples"]


def weighting_field(default: Weighting, what: str) -> Any:
    """The ``weighting`` hyperparameter; ``what`` says what the weights weigh."""
    return Field(default=default, description=f"{what}: uniform 1/K or samples n_k/n")


def aggregation_weight(weighting: str, num_train: int) -> float:
    """Client k's weight in a weighted average: n_k (``samples``) or 1 (``uniform``)."""
    return float(num_train) if weighting == "samples" else 1.0


def objective_weight(weighting: str, client_id: int, population: Mapping[int, int]) -> float:
    """p_k of client k in the global objective sum_k p_k F_k over the training clients
    ``population`` (client id -> n_k): n_k / n (``samples``) or 1/K (``uniform``)."""
    if weighting == "uniform":
        return 1.0 / len(population)
    return population[client_id] / sum(population.values())
