"""The pieces the FedProto and FedNTD tests share (tests/algorithms/test_fedproto.py,
test_fedntd.py): longer runs of the digits setup (4 rounds of 10 local steps), and a tiny 2NN
on 8x8 inputs whose features and logits are written out by hand, with clients holding known
labels."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fedloom
from fedloom.algorithms import AlgorithmContext
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.core.pytree import weighted_average
from fedloom.models import MLP
from fedloom.solvers.local import PlanMaker
from tests.algorithms import digits_setup

LONGER = {"rounds": 4, "local_steps": 10}


def digits_config(algorithm: dict, **train) -> dict:
    return digits_setup.digits_config(algorithm, **{**LONGER, **train})


def run(algorithm: dict, **train) -> fedloom.RunResult:
    return digits_setup.run_digits(algorithm, **{**LONGER, **train})


def max_difference(a: fedloom.RunResult, b: fedloom.RunResult) -> float:
    assert a.client_params.keys() == b.client_params.keys()
    return max(
        float((params[k] - b.client_params[c][k]).abs().max())
        for c, params in a.client_params.items()
        for k in params
    )


# -- a tiny 2NN on 8x8 inputs, with features computed by hand ------------------------------
HIDDEN = 6
CLASSES = 8


def make_ctx(population: dict[int, int], batch_size: int | None = None) -> AlgorithmContext:
    model = FunctionalModel(MLP((1, 8, 8), CLASSES, hidden=HIDDEN), "classification")
    return AlgorithmContext(
        model=model,
        seed=0,
        num_clients=len(population),
        lr=0.1,
        batch_size=batch_size,
        aggregate=weighted_average,
        make_plan=PlanMaker(0, batch_size),
        population=population,
    )


def features(params: dict, x: torch.Tensor) -> torch.Tensor:
    """h(x) of the MLP, the head's input, written out."""
    h = torch.relu(F.linear(x.flatten(1), params["fc1.weight"], params["fc1.bias"]))
    return torch.relu(F.linear(h, params["fc2.weight"], params["fc2.bias"]))


def logits(params: dict, x: torch.Tensor) -> torch.Tensor:
    return F.linear(features(params, x), params["fc3.weight"], params["fc3.bias"])


def client_data(labels: list[int], seed: int) -> ClientData:
    gen = torch.Generator().manual_seed(seed)
    y = torch.tensor(labels)
    x = torch.randn(len(labels), 1, 8, 8, generator=gen)
    return ClientData(x, y, x[:2], y[:2])


# each client's labels: class 2 is held by all three, 1 by two; 4, 6 and 7 by nobody
HELD = [[0, 1, 1, 2, 2, 2], [1, 2, 3, 3, 3, 3, 3], [2, 5, 5, 2, 2, 5, 5, 5, 5]]
