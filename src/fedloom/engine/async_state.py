"""The typed run state of the virtual clock and of asynchronous aggregation
(engine/asynchrony.py): the clients in flight and the server's buffer as :class:`Job` records.
Checkpoints hold them as plain dicts of values and tensors (engine/checkpoint.py), under the
same keys as these fields."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from fedloom.core.protocol import State


@dataclass
class Job:
    """One dispatched client: in flight until ``finish`` on the clock, then (FedBuff) in the
    buffer until the server steps."""

    client: int
    version: int
    """The server steps taken when the client was sent the model."""
    event: int
    """The dispatch event (the key of its random streams)."""
    start: float
    finish: float
    steps: int
    bytes: int
    """Its upload's bytes on the wire (counted on arrival)."""
    delta: dict[str, dict[str, Any]] | None = None
    """Its update from the model it was sent (``params`` and ``buffers``); None for a
    non-finite result, whose slot frees on arrival and nothing else."""
    weight: float = 0.0
    loss: float = 0.0
    info: dict[str, float] = field(default_factory=dict)
    state: State | None = None
    """The client's new persistent state, stored on arrival."""
    model: dict[str, dict[str, Any]] | None = None
    """FedAsync: the uploaded model itself (``params`` and ``buffers``)."""

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class AsyncState:
    """``RunState.asynchrony``: the clock (synchronous runs with speeds use only it) and
    asynchronous aggregation's progress."""

    clock: float = 0.0
    """Virtual time so far."""
    version: int = 0
    """Server steps taken."""
    events: int = 0
    """Dispatch events so far."""
    in_flight: list[Job] = field(default_factory=list)
    buffer: list[Job] = field(default_factory=list)
    applied: int = 0
    """Updates folded into the model."""
    staleness_sum: int = 0
    staleness_max: int = 0

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out["in_flight"] = [job.to_dict() for job in self.in_flight]
        out["buffer"] = [job.to_dict() for job in self.buffer]
        return out

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> AsyncState:
        """From ``to_dict``'s output (an empty dict: a fresh state)."""
        values = dict(saved)
        for key in ("in_flight", "buffer"):
            values[key] = [Job(**job) for job in values.get(key, [])]
        return cls(**values)
