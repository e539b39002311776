"""Clients whose local training diverged: a loss, upload or state that is not finite.

Such a client is never averaged or evaluated as if it were fine. ``train.nonfinite`` says what
happens instead: ``error`` (default) stops the run with a message naming the client, the round,
the algorithm and what to lower; ``drop`` leaves the client out of that round (its upload is not
aggregated, its personalized state keeps its previous value) and counts it
(``dropped_nonfinite`` in metrics.jsonl and summary.json).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from fedloom.core.protocol import ClientResult, ClientTask
from fedloom.errors import FedloomInputError
from fedloom.run_config.train import TrainConfig


class DivergenceError(FedloomInputError):
    """A client's training produced a non-finite loss or model (``train.nonfinite: error``)."""


class NonFiniteWarning(UserWarning):
    """Rounds in which every client diverged (``train.nonfinite: drop``): nothing learned."""


def warn_all_dropped(rounds: Sequence[int], lr: float) -> None:
    """Say, once at the end of a run, that in ``rounds`` every client was dropped."""
    if rounds:
        shown = ", ".join(map(str, rounds[:5])) + (" ..." if len(rounds) > 5 else "")
        warnings.warn(
            f"in {len(rounds)} round(s) ({shown}) every client's result was non-finite and "
            "dropped (train.nonfinite: drop), so the server model did not change; lower "
            f"train.lr ({lr}) or the local work",
            NonFiniteWarning,
            stacklevel=2,
        )


def _tensors(tree: Any, path: str) -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(tree, torch.Tensor):
        yield path, tree
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _tensors(value, f"{path}.{key}" if path else str(key))


def nonfinite_part(result: ClientResult) -> str | None:
    """What of ``result`` is not finite ('loss', 'upload KEY', 'state KEY'), or None."""
    if not math.isfinite(result.loss):
        return f"loss {result.loss}"
    for what, tree in (("upload", result.upload), ("state", result.state)):
        for path, tensor in _tensors(tree, ""):
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                return f"{what} '{path}'"
    return None


def _local_work(train: TrainConfig) -> str:
    if train.local_steps is not None:
        return f"train.local_steps: {_shown(train.local_steps)}"
    return f"train.local_epochs: {_shown(train.local_epochs)}"


def _shown(value: Any) -> str:
    return str(value.model_dump(exclude_none=True) if hasattr(value, "model_dump") else value)


def coefficients(algorithm: Mapping[str, Any]) -> list[str]:
    """``algorithm.KEY: value`` of the algorithm's real-valued hyperparameters."""
    return [
        f"algorithm.{k}: {v}"
        for k, v in algorithm.items()
        if isinstance(v, float) and not isinstance(v, bool)
    ]


def divergence_message(
    client: int, round: int, part: str, algorithm: Mapping[str, Any], train: TrainConfig
) -> str:
    coefs = coefficients(algorithm)
    lower = [f"train.lr: {train.lr}", f"the local work ({_local_work(train)})"]
    if coefs:
        lower.append(f"the algorithm's coefficients ({', '.join(coefs)})")
    return (
        f"client {client} diverged in round {round} under algorithm {algorithm['name']}: its "
        f"{part} is not finite. Lower {', '.join(lower[:-1])} or {lower[-1]}; or set "
        "train.nonfinite: drop to leave such clients out of the round (and count them)."
    )


def all_finite(results: Sequence[ClientResult]) -> bool:
    """A fast pass: whether every loss, upload and state of ``results`` is surely finite.
    Each tensor is summed once per underlying tensor (the vectorized executor's results are
    rows of a few stacked tensors: a handful of reductions, not one per client and tensor);
    NaN and infinity propagate through a sum. False (also when a finite sum overflows) sends
    the round to the exact check of each client."""
    wholes: dict[int, torch.Tensor] = {}

    def collect(tree: Any) -> None:  # no key paths: this pass runs every round
        for node in tree.values():
            if isinstance(node, torch.Tensor):
                base = node._base
                whole = node if base is None else base
                wholes[id(whole)] = whole  # one sum per stacked tensor, however many rows
            elif isinstance(node, Mapping):
                collect(node)

    for result in results:
        if not math.isfinite(result.loss):
            return False
        collect(result.upload)
        if result.state is not None:
            collect(result.state)
    return all(math.isfinite(float(t.sum())) for t in wholes.values() if t.is_floating_point())


@dataclass
class Screened:
    """The clients of a round that trained finitely, and those left out."""

    tasks: list[ClientTask]
    results: list[ClientResult]
    dropped: list[int] = field(default_factory=list)


def screen(
    tasks: Sequence[ClientTask],
    results: Sequence[ClientResult],
    round: int,
    algorithm: Mapping[str, Any],
    train: TrainConfig,
) -> Screened:
    """Apply ``train.nonfinite`` to a round's results (in the order of ``tasks``)."""
    if all_finite(results):
        return Screened(list(tasks), list(results))
    kept = Screened([], [])
    for task, result in zip(tasks, results, strict=True):
        part = nonfinite_part(result)
        if part is None:
            kept.tasks.append(task)
            kept.results.append(result)
        elif train.nonfinite == "error":
            raise DivergenceError(divergence_message(task.client_id, round, part, algorithm, train))
        else:
            kept.dropped.append(task.client_id)
    return kept
