"""Executors run the sampled clients' updates of one round. All executors must return the
same results for the same tasks; only how the work is scheduled differs."""

from __future__ import annotations

from typing import Protocol

from fedloom.algorithms.base import Algorithm
from fedloom.core.protocol import ClientData, ClientResult, ClientTask, Message, State
from fedloom.core.pytree import Tree
from fedloom.engine.metrics import EvalCounts

States = list[State | None]
"""The round's clients' persistent states, in task order (None: the algorithm keeps none)."""


class Executor(Protocol):
    """Runs the sampled clients' local updates of one round.

    ``prepare`` is called once with every ClientData the run will use, by client id (so an
    executor can place data once: an arena for the vectorized executor, the object store for
    Ray, the forked workers' memory); tasks then name their client by id.
    ``close`` once at the end of the run, also after an error.
    """

    name: str
    batches_clients: bool
    """Whether clients run stacked (the vectorized backend): per-client fine-tuning outside
    the round (the cold-start curve) then runs stacked too."""

    def prepare(self, clients: dict[int, ClientData]) -> None: ...

    def close(self) -> None: ...

    def run_round(
        self, algorithm: Algorithm, message: Message, tasks: list[ClientTask], states: States
    ) -> list[ClientResult]: ...

    def evaluate(
        self, models: list[tuple[Tree, Tree]], datas: list[ClientData], batch_size: int
    ) -> list[EvalCounts]:
        """Each (params, buffers) model on its client's held-out data."""
        ...

    def deployed_models(
        self, algorithm: Algorithm, server: State, states: States, tasks: list[ClientTask]
    ) -> list[tuple[Tree, Tree]]:
        """Every client's deployed model (``Deployment.deployed_models``), where this
        executor runs clients: fine-tuning deployments (FedAvg-FT) train there too."""
        ...
