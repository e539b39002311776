"""The callback contract of the round loop (engine/loop.py): what a callback may read, a
frozen :class:`RunContext`, and what it gives back, the metrics it adds to the round's row and
its part of summary.json, which the loop merges in the declared callback order. Nothing here
imports the loop, so the callbacks, contribution evaluation, serving copies and the virtual
clock stand below it (pfl-research's callbacks around a short loop; docs/monitoring.md,
docs/incentives.md, docs/serving.md, docs/asynchrony.md)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from fedloom.algorithms import Algorithm
from fedloom.config import RunConfig
from fedloom.core import pytree
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.data.federated import FederatedData
from fedloom.engine.executor import Executor
from fedloom.engine.mechanisms import Mechanisms
from fedloom.engine.metrics import EvalCounts
from fedloom.engine.rundir import RunDir
from fedloom.engine.sampling import TrainingClients

if TYPE_CHECKING:
    from fedloom.engine.state import RoundReport, RunState


class EvaluatedModels(Protocol):
    """What the latest evaluation left for later callbacks (the attack report, the serving
    copies): each client's deployed model and the global model's counts per client."""

    @property
    def deployed(self) -> dict[int, pytree.Tree]: ...

    @property
    def global_counts(self) -> list[EvalCounts]: ...


@dataclass(frozen=True)
class RunContext:
    """Everything a callback reads about the run, read-only (its attributes cannot be set;
    the state that changes lives in ``RunState``)."""

    config: RunConfig
    data: FederatedData
    """The clients' data as they train on it (hidden features zeroed, poisoned if attacked)."""
    model: FunctionalModel
    algorithm: Algorithm
    executor: Executor
    run_dir: RunDir | None
    train_ids: tuple[int, ...]
    new_ids: tuple[int, ...]
    """The held-out new clients (``eval.new_clients``; engine/cold_start.py)."""
    training: TrainingClients
    validation: tuple[ClientData, ...] | None
    """Each client's validation set (eval.validation_fraction; data/validation.py)."""
    validation_pool: ClientData | None
    """All training clients' validation sets as one: the server's held-out set."""
    mechanisms: Mechanisms
    evaluation: EvaluatedModels


class Callback:
    """Hooks around the round loop; each does nothing unless overridden. A hook reads the
    context and the run state (it may keep its own part of the state in ``RunState`` for
    checkpoints) and returns what it adds: a returned None counts as nothing."""

    def on_run_start(self, ctx: RunContext, state: RunState) -> None:
        pass

    def on_round_end(self, ctx: RunContext, state: RunState, report: RoundReport) -> dict[str, Any]:
        """The metrics this callback adds to the round's row (``report.metrics`` holds those
        of the callbacks before it)."""
        return {}

    def on_run_end(self, ctx: RunContext, state: RunState) -> dict[str, Any]:
        """This callback's part of summary.json."""
        return {}

    def on_summary(self, ctx: RunContext, summary: Mapping[str, Any]) -> None:
        """The finished summary.json (every callback's part merged; not to be changed)."""

    def on_failure(self, ctx: RunContext) -> None:
        """The run stopped on an error (after ``on_run_start``)."""


def merge(into: dict[str, Any], part: Mapping[str, Any] | None) -> None:
    """Merge a callback's returned ``part`` into a metrics row or summary: a key whose old and
    new values are both dicts gets their union (``seconds``, summary.json's ``final``), any
    other key the new value."""
    for key, value in (part or {}).items():
        old = into.get(key)
        if isinstance(old, dict) and isinstance(value, Mapping):
            into[key] = {**old, **value}
        else:
            into[key] = value
