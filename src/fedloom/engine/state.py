"""The typed state of a run and the report of one round, as the round loop hands them to its
callbacks (engine/callbacks.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fedloom.core.protocol import ClientResult, ClientTask, Message, State
from fedloom.engine.async_state import AsyncState
from fedloom.engine.state_store import ClientStateStore


@dataclass
class RunState:
    """Everything a resumed run needs: checkpointed as a whole (engine/checkpoint.py)."""

    server: State
    clients: ClientStateStore
    round: int = 0
    """The last completed round."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """One metrics row per evaluated round (metrics.jsonl)."""
    bytes_up: int = 0
    bytes_down: int = 0
    elapsed: float = 0.0
    """Wall seconds of the run so far (continued by a resumed run)."""
    dropped_nonfinite: int = 0
    """Client results left out as non-finite (``train.nonfinite: drop``)."""
    executor_choice: str | None = None
    """``auto``'s choice, so that a resumed run continues on the same executor."""
    mechanisms: dict[str, Any] = field(default_factory=dict)
    """The state of the run's mechanisms (engine/mechanisms.py) by name: ``privacy``
    (adaptive clipping's bound, DP-SGD's steps per client), ``secure`` (secure aggregation's
    counters), ``robust`` (skipped rounds)."""
    asynchrony: AsyncState = field(default_factory=AsyncState)
    """The virtual clock and, for asynchronous aggregation, the clients in flight and the
    server's buffer (engine/async_state.py)."""
    serving: dict[str, Any] = field(default_factory=dict)
    """The deployable copies kept across rounds (serving section; engine/serving.py): the
    best global model by validation metric and its round, each client's best, the EMA."""

    def checkpoint(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "server": self.server,
            "clients": self.clients.state_dict(),
            "history": self.history,
            "bytes_up": self.bytes_up,
            "bytes_down": self.bytes_down,
            "elapsed": self.elapsed,
            "dropped_nonfinite": self.dropped_nonfinite,
            "executor_choice": self.executor_choice,
            "mechanisms": self.mechanisms,
            "asynchrony": self.asynchrony.to_dict(),
            "serving": self.serving,
        }

    @classmethod
    def from_checkpoint(cls, saved: dict[str, Any], store: ClientStateStore) -> RunState:
        store.load_state_dict(saved["clients"])
        return cls(
            server=saved["server"],
            clients=store,
            round=saved["round"],
            history=saved["history"],
            bytes_up=saved["bytes_up"],
            bytes_down=saved["bytes_down"],
            elapsed=saved["elapsed"],
            dropped_nonfinite=saved.get("dropped_nonfinite", 0),
            executor_choice=saved.get("executor_choice"),
            mechanisms=saved.get("mechanisms") or {},
            asynchrony=AsyncState.from_dict(saved.get("asynchrony") or {}),
            serving=saved.get("serving") or {},
        )


@dataclass
class RoundReport:
    """One trained round: what the clients were sent and returned, and what the callbacks
    add to the round's metrics row (only evaluated rounds get a row)."""

    round: int
    participants: list[int]
    """The sampled clients (stragglers dropped by ``straggler_mode: drop`` included)."""
    message: Message
    tasks: list[ClientTask]
    results: list[ClientResult]
    """The reports aggregated this round (non-finite ones already left out)."""
    bytes_up: int
    bytes_down: int
    train_seconds: float
    evaluate: bool
    """Whether this round is evaluated (``eval.every``, and the last round)."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """What the callbacks measured (evaluation, monitoring, privacy), merged into the row
    (the loop merges each callback's returned metrics here; engine/context.py)."""

    @property
    def train_loss(self) -> float | None:
        total = sum(r.weight for r in self.results)
        return sum(r.loss * r.weight for r in self.results) / total if total else None

    def client_info(self) -> dict[str, float]:
        """Per key, the mean over the round's reports of the numbers clients put in
        ``ClientResult.info`` (e.g. pFedMac's sparsity)."""
        keys = sorted({k for r in self.results for k in r.info})
        out = {}
        for key in keys:
            values = [float(r.info[key]) for r in self.results if key in r.info]
            out[key] = sum(values) / len(values)
        return out
