"""What a run expects of a checkpoint before it resumes from it (or an audit reads its models):
the checkpoint of a run is whole when its checksums hold (engine/checkpoint.py), and it fits
the run reading it when

- its payload has the types of a ``RunState`` checkpoint (engine/state.py): the round a
  count, the history a list of rows, the client tables tensors, the served copies trees;
- every tensor at a place the run's fresh state also has one (the server's parameters and
  optimizer state) has that tensor's dtype and shape, and every value there its kind (a
  number, a string, a mapping);
- every tensor holding a model weight by name (``.../params/linear.weight``: the server's, a
  client's personal model; the served copies) has the model's dtype and shape; a client
  table's rows end in that shape;
- every client table has one row per client slot;
- no floating-point tensor holds NaN or infinity.

Anything else is a ``CheckpointMismatch`` naming the tensor or key and what the run expects:
the checkpoint counts as damaged, and the run directory falls back to the older one
(engine/rundir.py, ``latest_checkpoint``). Nothing is cast: an int32 copy of float32 weights is
refused, not converted.
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
from pydantic import ConfigDict, Field, InstanceOf, field_validator

from fedloom.core.run_files import type_problem
from fedloom.core.settings import StrictModel
from fedloom.engine.checkpoint import Check, CheckpointMismatch, check_finite, describe, encode

Count = Annotated[int, Field(ge=0)]
Tensor = InstanceOf[torch.Tensor]
Tree = dict[str, Tensor]

TABLES = "clients/tables/"
"""Where the client state store's tables sit in a checkpoint's tensor file."""


class _Payload(StrictModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)


class _Row(_Payload):
    model_config = ConfigDict(extra="allow")
    round: Count


class _Clients(_Payload):
    num_clients: Count
    present: Tensor
    none: list[int]
    empty: list[str]
    tables: dict[str, Tensor]


class _Serving(_Payload):
    """engine/serving.py's kept copies (``ServingCopies.state``)."""

    ema: Tree | None = None
    ema_steps: Count | None = None
    best: Tree | None = None
    best_round: Count | None = None
    best_value: float | None = None
    clients_best: dict[int, Tree] | None = None
    clients_best_value: dict[int, float] | None = None
    clients_best_round: dict[int, Count] | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _not_null(cls, value: Any) -> Any:
        if value is None:  # a copy not kept is absent, never null
            raise ValueError("absent or a value, not null")
        return value


class RunPayload(_Payload):
    """A horizontal run's checkpoint (``RunState.checkpoint`` and the config it ran under)."""

    round: Count
    server: dict[str, Any]
    clients: _Clients
    history: list[_Row]
    bytes_up: Count
    bytes_down: Count
    elapsed: float
    dropped_nonfinite: Count = 0
    executor_choice: str | None = None
    mechanisms: dict[str, Any] = Field(default_factory=dict)
    asynchrony: dict[str, Any] = Field(default_factory=dict)
    serving: _Serving = Field(default_factory=_Serving)
    config: dict[str, Any] | None = None


def unescape(part: str) -> str:
    """A flattened key's component back (engine/checkpoint.py escapes as RFC 6901 does)."""
    return part.replace("~1", "/").replace("~0", "~")


WEIGHT_PARENTS = ("params", "buffers")
"""The tree keys under which a state keeps a model's weights by name (``server/params/...``,
a client table ``personal/params/...``)."""
SERVED = "serving/"
"""The served copies (engine/serving.py): model state dicts by weight name."""


def weight_name(key: str) -> str | None:
    """The model weight a checkpoint tensor key holds a copy of (``linear.weight`` for
    ``server/inner/params/linear.weight``, ``clients/tables/personal~1params~1linear.weight``
    and ``serving/ema/linear.weight``), or None: only these places hold weights as the model
    shapes them (a compressor's residual, keyed by weight name too, is flat)."""
    parts = "/".join(unescape(p) for p in key.split("/")).split("/")
    if key.startswith(SERVED) or (len(parts) > 1 and parts[-2] in WEIGHT_PARENTS):
        return parts[-1]
    return None


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "a bool"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, list | tuple):
        return "a list"
    if isinstance(value, torch.Tensor):
        return "a tensor"
    return type(value).__name__


def same_kinds(expected: Any, saved: Any, path: str, whole: bool = False) -> None:
    """``saved`` has ``expected``'s kind at every key both have (None expects anything: a
    slot filled later); with ``whole``, every key of ``expected`` too."""
    if expected is None:
        return
    if _kind(expected) != _kind(saved):
        raise CheckpointMismatch(f"{path} is {_kind(saved)}, the run expects {_kind(expected)}")
    if isinstance(expected, dict):
        missing = [k for k in expected if k not in saved] if whole else []
        if missing:
            raise CheckpointMismatch(f"{path} has no {missing[0]!r}, which the run's state has")
        for key in expected.keys() & saved.keys():
            same_kinds(expected[key], saved[key], f"{path}/{key}", whole)


def run_fit(weights: dict[str, torch.Tensor], fresh: dict[str, Any], slots: int) -> Check:
    """The check of a run whose model has ``weights`` (name -> tensor), whose state before
    round 1 is the payload ``fresh`` and whose client tables have ``slots`` rows."""
    _, fresh_tensors = encode(fresh)

    def expected(key: str, tensor: torch.Tensor) -> tuple[torch.dtype, tuple[int, ...]] | None:
        """The dtype and shape the run expects of ``tensor`` at ``key`` (None: unknown)."""
        if key in fresh_tensors:
            t = fresh_tensors[key]
            return t.dtype, tuple(t.shape)
        w = weights.get(weight_name(key) or "")
        if w is None:
            return None
        if key.startswith(TABLES):
            # rows of the weight's shape, or of several of them (a stack per client)
            middle = tuple(tensor.shape[1 : max(1, tensor.ndim - w.ndim)])
            return w.dtype, (slots, *middle, *w.shape)
        return w.dtype, tuple(w.shape)

    def check(payload: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        problem = type_problem(payload, RunPayload)
        if problem is not None:
            raise CheckpointMismatch(f"its payload's {problem}")
        same_kinds(fresh.get("server"), payload["server"], "server", whole=True)
        for part in ("asynchrony", "mechanisms"):
            same_kinds(fresh.get(part), payload[part], part)
        for key, tensor in tensors.items():
            if key.startswith(TABLES) and (tensor.ndim == 0 or tensor.shape[0] != slots):
                raise CheckpointMismatch(
                    f"tensor {key} is {describe(tensor)}; the run's client tables have "
                    f"{slots} rows (one per client, and one for the pooled client)"
                )
            want = expected(key, tensor)
            if want is not None and (tensor.dtype, tuple(tensor.shape)) != want:
                dtype, shape = want
                raise CheckpointMismatch(
                    f"tensor {key} is {describe(tensor)}, the run expects "
                    f"{str(dtype).removeprefix('torch.')} {list(shape)}"
                )
        check_finite(tensors)
        present = payload["clients"]["present"]
        if present.dtype != torch.bool or tuple(present.shape) != (slots,):
            raise CheckpointMismatch(
                f"tensor clients/present is {describe(present)}, the run expects bool [{slots}]"
            )

    return check


class ShellPayload(_Payload):
    """A checkpoint of the run shell (engine/shell.py: federated RL and vertical runs)."""

    round: Count
    state: Any
    history: list[dict[str, Any]]
    wall_seconds: float
    config: dict[str, Any] | None = None


def shell_fit(payload: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """The run shell's check: its payload's types (the family's state is its own to check)."""
    problem = type_problem(payload, ShellPayload)
    if problem is not None:
        raise CheckpointMismatch(f"its payload's {problem}")
    check_finite(tensors)
