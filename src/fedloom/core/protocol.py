"""The types of the client protocol: what the engine hands one client for one round, and what
comes back. Shared by the solvers (which run clients), the algorithms (which define them) and the
engine (which schedules them)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from fedloom.core.pytree import Tree


@dataclass
class ClientData:
    """One client's data as tensors (views into shared storage where possible, never copies
    per round). ``x`` has the model's input shape per sample; ``y`` is int64 class ids
    (classification) or float32 targets of shape (n,) or (n, d) (regression)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor

    @property
    def num_train(self) -> int:
        return int(self.x_train.shape[0])

    @property
    def num_test(self) -> int:
        return int(self.x_test.shape[0])


State = dict[str, Any]
"""A server's or client's persistent state: a (nested) dict of tensors and trees."""

Message = dict[str, Tree]
"""What travels between server and client, namespaced (``params``, ``buffers``, ``grad`` ...)."""


MakePlan = Callable[[ClientData, int, str, int, int], list[torch.Tensor]]
"""``(data, steps, purpose, round, client) -> minibatch index tensors`` (solvers/local.py)."""


@dataclass
class ClientTask:
    """One client's work order for one round, prepared by the engine."""

    client_id: int
    data: ClientData
    plan: list[torch.Tensor]
    """Minibatch index tensors, one per local step (stragglers get a truncated plan)."""
    lr: float
    round: int
    full: int | None = None
    """Local steps the client was asked for (``len(plan)`` is what it completed: fewer for a
    straggler). None: not recorded, same as ``len(plan)``."""

    @classmethod
    def order(
        cls,
        client_id: int,
        data: ClientData,
        lr: float,
        round: int,
        make_plan: MakePlan | None = None,
        steps: int = 0,
        full: int | None = None,
    ) -> ClientTask:
        """The work order of ``client_id`` in ``round``: ``steps`` minibatches that
        ``make_plan`` draws from the client's (seed, round, client, "batches") stream
        (solvers/local.py, ``PlanMaker``), of the ``full`` steps it was asked for (a straggler
        completes fewer); without ``make_plan``, no minibatches (a client the engine only
        deploys or adapts: evaluation, cold start)."""
        plan = [] if make_plan is None else make_plan(data, steps, "batches", round, client_id)
        return cls(client_id, data, plan, lr, round, full)


@dataclass
class ClientResult:
    """One client's answer for one round: what it uploads (counted as communication), its
    aggregation weight, its new persistent state and metrics that never travel."""

    upload: Message
    weight: float
    """Aggregation weight proposed by the client (its number of training samples)."""
    loss: float
    state: State | None = None
    info: dict[str, float] = field(default_factory=dict)
    """Metrics of the round (averaged over clients into metrics.jsonl); not uploaded."""
    client_id: int = -1
    round: int = -1
    """Who produced the result, and when: set by the backend that ran the client."""

    def stamped(self, task: ClientTask) -> ClientResult:
        """This result marked as client ``task.client_id``'s of round ``task.round``."""
        self.client_id, self.round = task.client_id, task.round
        return self
