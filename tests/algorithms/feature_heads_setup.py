"""What the FedCP and GPFL tests share: their models on the digits 2NN, one client's task, and a
2NN whose head has no bias (where both reduce exactly to FedPer / FedRep)."""

from __future__ import annotations

from typing import Any

from torch import nn

from fedloom.algorithms import ALGORITHMS, AlgorithmContext, ClientTask, parse_algorithm_config
from fedloom.config import parse_config
from fedloom.core.functional import FunctionalModel
from fedloom.data.load import load_dataset
from fedloom.models import MLP
from fedloom.solvers.local import PlanMaker
from tests.algorithms.digits_setup import DIRICHLET, digits_config, digits_ctx


class BiasFreeHead(MLP):
    """The 2NN with a head without bias (W h): the extra bias of a second head vanishes."""

    def __init__(self, input_shape: tuple[int, ...], num_outputs: int) -> None:
        super().__init__(input_shape, num_outputs)
        self.fc3 = nn.Linear(self.fc2.out_features, num_outputs, bias=False)


def wrapped_ctx(algorithm: dict[str, Any], batch_size: int = 8) -> AlgorithmContext:
    """digits_ctx with the algorithm's own model around the digits 2NN."""
    ctx = digits_ctx()
    cfg = parse_algorithm_config(algorithm)
    module = ALGORITHMS.get(cfg.name).model_for(MLP((1, 8, 8), 10), cfg)
    ctx.model = FunctionalModel(module, "classification")
    ctx.batch_size, ctx.make_plan = batch_size, PlanMaker(0, batch_size)
    return ctx


def digits_task(client: int, steps: int, lr: float = 0.1, batch_size: int = 8) -> ClientTask:
    """Client ``client`` of the Dirichlet digits clients, ``steps`` minibatches of round 1."""
    cfg = parse_config(digits_config({"name": "fedavg"}, partition=DIRICHLET))
    data = load_dataset(cfg.data, cfg.seed).clients[client]
    plan = PlanMaker(0, batch_size)(data, steps, "batches", 1, client)
    return ClientTask(client, data, plan, lr, 1)
