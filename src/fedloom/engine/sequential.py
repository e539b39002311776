"""The sequential executor: the reference, one client after another in this process."""

from __future__ import annotations

from fedloom.algorithms.base import Algorithm
from fedloom.algorithms.client import client_program
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData, ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.engine.evaluation import evaluate_each
from fedloom.engine.executor import States
from fedloom.engine.memory import keep_large_blocks_in_heap
from fedloom.engine.metrics import EvalCounts
from fedloom.solvers.sequential import run_client


class SequentialExecutor:
    """The reference: one client after another in this process."""

    name = "sequential"
    batches_clients = False

    def __init__(self, model: FunctionalModel | None = None) -> None:
        self.model = model
        # each client's result is fresh memory that lives until aggregation; kept in the heap
        # it is reused round after round instead of page-faulted in (benchmarks/README.md,
        # Design measurements)
        keep_large_blocks_in_heap()

    def prepare(self, clients: dict[int, ClientData]) -> None:
        pass

    def evaluate(
        self, models: list[tuple[Tree, Tree]], datas: list[ClientData], batch_size: int
    ) -> list[EvalCounts]:
        assert self.model is not None, "SequentialExecutor(model) is needed to evaluate"
        return evaluate_each(self.model, models, datas, batch_size)

    def close(self) -> None:
        pass

    def deployed_models(
        self, algorithm: Algorithm, server: State, states: States, tasks: list[ClientTask]
    ) -> list[tuple[Tree, Tree]]:
        return algorithm.deployment.deployed_models(server, states, tasks)

    def run_round(
        self, algorithm: Algorithm, message: Message, tasks: list[ClientTask], states: States
    ) -> list[ClientResult]:
        program = client_program(algorithm)
        return [run_client(program, message, s, t) for t, s in zip(tasks, states, strict=True)]
