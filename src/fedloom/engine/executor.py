"""Executors run the sampled clients' updates of one round. All executors must return the
same results for the same tasks; only how the work is scheduled differs."""

from __future__ import annotations

from typing import Protocol

from fedloom.algorithms.base import Algorithm, ClientResult, ClientTask, Message, State
from fedloom.errors import ConfigError


class Executor(Protocol):
    name: str

    def run_round(
        self,
        algorithm: Algorithm,
        message: Message,
        tasks: list[ClientTask],
        states: list[State | None],
    ) -> list[ClientResult]: ...


class SequentialExecutor:
    """The reference: one client after another in this process."""

    name = "sequential"

    def run_round(
        self,
        algorithm: Algorithm,
        message: Message,
        tasks: list[ClientTask],
        states: list[State | None],
    ) -> list[ClientResult]:
        return [algorithm.client_update(message, s, t) for t, s in zip(tasks, states, strict=True)]


def make_executor(kind: str) -> Executor:
    if kind in ("sequential", "auto"):
        return SequentialExecutor()
    raise ConfigError(
        f"executor.kind: '{kind}' is not available in this version of fedloom; "
        "use 'sequential' (or 'auto', which currently selects it)"
    )
