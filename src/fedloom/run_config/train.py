"""The ``train``, ``eval`` and ``checkpoint`` sections of a run config."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    Discriminator,
    Field,
    PositiveInt,
    Tag,
    field_validator,
    model_serializer,
    model_validator,
)

from fedloom.core.settings import LIST_AS_TUPLE, StrictModel
from fedloom.solvers.adamw import AdamW


class WorkDistribution(StrictModel):
    """Local work (epochs or steps) that differs between clients (system heterogeneity).

    - ``uniform {low, high}``: an integer drawn uniformly from low..high (inclusive);
    - ``choice {values, probs}``: one of ``values`` (with ``probs``, else uniformly);
    - ``per_client {values}``: client i always does ``values[i]``.
    Random draws are made afresh every round (``per: round``) or once per client for the whole
    run (``per: client``), from the stream (seed, round, client, 'work').
    """

    kind: Literal["uniform", "choice", "per_client"]
    low: int | None = Field(default=None, ge=1)
    high: int | None = Field(default=None, ge=1)
    values: list[int] | None = None
    probs: list[float] | None = None
    per: Literal["round", "client"] = "round"

    @model_validator(mode="after")
    def _complete(self) -> WorkDistribution:
        if self.kind == "uniform":
            if self.low is None or self.high is None or self.low > self.high:
                raise ValueError("kind uniform needs integers low <= high (both >= 1)")
        else:
            if not self.values or any(v < 1 for v in self.values):
                raise ValueError(f"kind {self.kind} needs values: a list of integers >= 1")
            if self.probs is not None:
                if self.kind != "choice":
                    raise ValueError("probs applies only to kind choice")
                if len(self.probs) != len(self.values) or any(q < 0 for q in self.probs):
                    raise ValueError("probs needs one non-negative number per value")
                if abs(sum(self.probs) - 1.0) > 1e-6:
                    raise ValueError(f"probs must sum to 1 (got {sum(self.probs)})")
        return self


def _work_kind(value: Any) -> str:
    return "distribution" if isinstance(value, dict | WorkDistribution) else "count"


Work = Annotated[
    Annotated[PositiveInt, Tag("count")] | Annotated[WorkDistribution, Tag("distribution")],
    Discriminator(_work_kind),
]
"""A fixed number, or a WorkDistribution mapping."""


class OptimizerConfig(StrictModel):
    """The clients' local optimizer (``train.optimizer``; docs/optimizers.md): ``sgd``, the
    algorithm's own SGD steps, or ``adamw`` (Loshchilov and Hutter 2019; solvers/adamw.py) at
    ``train.lr``, with ``torch.optim.AdamW``'s defaults. ``moments``: AdamW's first and second
    moments start from zero every round (``round``) or persist in each client's state across
    rounds (``client``; algorithms that keep client state). A plain string is the kind."""

    kind: Literal["sgd", "adamw"] = "sgd"
    betas: Annotated[tuple[float, float], LIST_AS_TUPLE] = (0.9, 0.999)
    eps: float = Field(default=1e-8, gt=0.0)
    weight_decay: float = Field(default=0.01, ge=0.0)
    moments: Literal["round", "client"] = "round"

    @model_validator(mode="before")
    @classmethod
    def _kind_only(cls, value: Any) -> Any:
        return {"kind": value} if isinstance(value, str) else value

    @field_validator("betas")
    @classmethod
    def _betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"betas must both be in [0, 1), got {list(betas)}")
        return betas

    @model_validator(mode="after")
    def _adamw_keys(self) -> OptimizerConfig:
        fields = type(self).model_fields
        stray = sorted(
            k for k in self.model_fields_set - {"kind"} if getattr(self, k) != fields[k].default
        )
        if self.kind == "sgd" and stray:
            raise ValueError(f"{', '.join(stray)} applies only to kind: adamw (got kind: sgd)")
        return self

    @model_serializer(mode="wrap")
    def _serialize(self, handler: Any) -> dict[str, Any]:
        """SGD as ``{kind: sgd}``: AdamW's keys do not apply to it."""
        out = handler(self)
        return {"kind": "sgd"} if self.kind == "sgd" else out

    def adamw(self) -> AdamW | None:
        """The solvers' AdamW settings (solvers/adamw.py), or None for SGD."""
        if self.kind != "adamw":
            return None
        return AdamW(self.betas, self.eps, self.weight_decay, self.moments == "client")


class TrainConfig(StrictModel):
    rounds: int = Field(default=20, ge=1)
    clients_per_round: int | None = Field(default=None, ge=1)
    local_epochs: Work | None = None
    local_steps: Work | None = None
    batch_size: int | None = Field(default=32, ge=1)
    lr: float = Field(default=0.05, gt=0.0)
    stragglers: float = Field(default=0.0, ge=0.0, lt=1.0)
    straggler_mode: Literal["partial", "drop"] = "partial"
    """partial: a straggler does a uniform share 1..S of its S steps and is aggregated;
    drop: the server drops it (FedProx paper: FedAvg drops stragglers, FedProx keeps them)."""
    nonfinite: Literal["error", "drop"] = "error"
    """A client whose loss, upload or state is not finite (diverged): error: stop the run naming
    the client, the round and what to lower; drop: leave it out of that round's aggregation
    (its personalized state keeps its previous value) and count it (``dropped_nonfinite``)."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """The local optimizer: sgd (default) or adamw {betas, eps, weight_decay, moments}."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Fraction of each round's sampled clients that vanish mid-round (engine/dropout.py):
    floor(dropout x sampled) of them, each at a stage drawn uniformly from secure
    aggregation's three (after advertising keys, after sharing them, after sending its masked
    input). The first two never upload; the last has uploaded and is summed. The same
    clients drop at the same stages under every ``secure_aggregation.kind``, so runs show
    what each protocol survives (docs/secure_aggregation.md)."""

    @model_validator(mode="after")
    def _one_budget(self) -> TrainConfig:
        if self.local_epochs is not None and self.local_steps is not None:
            raise ValueError(
                "set exactly one of train.local_epochs and train.local_steps, not both"
            )
        if self.local_epochs is None and self.local_steps is None:
            object.__setattr__(self, "local_epochs", 1)
        return self


class EvalConfig(StrictModel):
    every: int = Field(default=5, ge=1)
    new_clients: int = Field(default=0, ge=0)
    """Clients held out of training entirely; evaluated every round as they would be served,
    and at the end by the cold-start evaluation (accuracy vs adaptation steps)."""
    batch_size: int = Field(default=1024, ge=1)
    adaptation_steps: list[int] = Field(default=[0, 1, 5, 20], min_length=1)
    """Cold start: a new client's accuracy after each of these many fine-tuning steps."""
    adapt_lr: float | None = Field(default=None, gt=0)
    """Cold start step size (default: the algorithm's own, e.g. Per-FedAvg's alpha, else
    train.lr)."""
    validation_fraction: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Share of each training client's train set held out as its validation set, which no
    client trains on (data/validation.py). Metrics rows then get a ``validation`` entry:
    what hyperparameter search, keeping the best model and contribution evaluation read,
    so that the test sets stay untouched."""

    @field_validator("adaptation_steps")
    @classmethod
    def _sorted_steps(cls, steps: list[int]) -> list[int]:
        if any(s < 0 for s in steps):
            raise ValueError("adaptation steps must be >= 0")
        return sorted(set(steps))


class CheckpointConfig(StrictModel):
    every: int | None = Field(default=10, ge=1)
    keep: int = Field(default=2, ge=1)
