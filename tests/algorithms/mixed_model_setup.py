"""The least-squares clients of the L2SGD and pFedMe tests (tests/algorithms/test_l2sgd.py,
test_pfedme.py): ``feature_skew: false``, 100 samples, Hessians with eigenvalues in
[1.14, 3.46] and local optima 1.2-3.3 apart from the uniform consensus optimum; their
quadratics and the runs' initial model."""

from __future__ import annotations

import torch

from fedloom.core.functional import FunctionalModel
from fedloom.models import build_model
from tests.algorithms.oracle import (
    as_vector,
    optimum_vector,
    quadratic_data,
)

K = 5


def clients():
    """K least-squares clients of 100 samples without feature skew (the module docstrings)."""
    return quadratic_data(num_clients=K, seed=0, samples=100, feature_skew=False)


def hessians_and_optima(data) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(H_k, w_k*): grad F_k(w) = H_k (w - w_k*) for the mean squared error F_k."""
    hessians = [h.double() for h in data.extras["hessians"]]
    return hessians, [optimum_vector(o) for o in data.extras["local_optima"]]


def initial_vector(data) -> torch.Tensor:
    model = FunctionalModel(build_model("logreg", data.input_shape, data.num_outputs), data.task)
    return as_vector(model.initial_state(0)[0])  # run seed 0 (oracle.run)


def personal(result) -> list[torch.Tensor]:
    return [as_vector(result.client_params[k]) for k in range(K)]


def max_distance(models: list[torch.Tensor], targets: list[torch.Tensor]) -> float:
    return max(float((m - t).norm()) for m, t in zip(models, targets, strict=True))
