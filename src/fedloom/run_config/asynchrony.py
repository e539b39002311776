"""The ``asynchrony`` section of a run config and its clients' ``speeds``
(docs/asynchrony.md)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedloom.core.settings import StrictModel


class SpeedsConfig(StrictModel):
    """Each client's time per local step on the virtual clock (engine/clock.py): a median
    m_c fixed per client, times exp(jitter * N(0, 1)) drawn per job."""

    kind: Literal["constant", "lognormal", "stragglers", "per_client"] = "constant"
    sigma: float = Field(default=1.0, ge=0.0)
    """lognormal: m_c = exp(sigma * N(0, 1)), drawn once per client."""
    fraction: float = Field(default=0.5, ge=0.0, le=1.0)
    """stragglers: the share of clients (chosen once with the seed) that are slow."""
    slowdown: float = Field(default=10.0, ge=1.0)
    """stragglers: how many times slower a slow client's step is."""
    values: list[float] | None = None
    """per_client: m_c of client c (one positive number per client)."""
    jitter: float = Field(default=0.0, ge=0.0)
    """Spread of each job's time around the client's median (lognormal, per job)."""

    @model_validator(mode="after")
    def _complete(self) -> SpeedsConfig:
        if self.kind == "per_client" and (not self.values or min(self.values) <= 0):
            raise ValueError("kind per_client needs values: one positive time per client")
        if self.values is not None and self.kind != "per_client":
            raise ValueError(f"values applies only to kind per_client, not {self.kind}")
        return self


class AsynchronyConfig(StrictModel):
    """Asynchronous aggregation on a virtual clock (docs/asynchrony.md): FedAsync (Xie et al.
    2019) mixes each arriving model in with weight alpha * s(staleness); FedBuff (Nguyen et al.
    2022) applies the mean of every ``buffer`` arriving updates. With ``kind: none`` and
    ``speeds`` set, the synchronous rounds get the same clock (round time: the slowest client)."""

    kind: Literal["none", "fedasync", "fedbuff"] = "none"
    buffer: int = Field(default=10, ge=1)
    """fedbuff: K, the updates per server step."""
    staleness: Literal["constant", "polynomial", "hinge"] = "polynomial"
    """s(d) of FedAsync section 5.2; fedbuff scales each update by it too."""
    a: float = Field(default=0.5, ge=0.0)
    """polynomial: s(d) = (d + 1)^-a; hinge: the slope a."""
    b: float = Field(default=4.0, ge=0.0)
    """hinge: s(d) = 1 up to staleness b."""
    alpha: float = Field(default=0.6, gt=0.0, le=1.0)
    """fedasync: the mixing weight alpha (alpha_t = alpha * s(d))."""
    server_lr: float = Field(default=1.0, gt=0.0)
    """fedbuff: eta_g, the step along the buffered mean update."""
    weighting: Literal["samples", "uniform"] = "samples"
    """fedbuff: updates weighted by the clients' samples (FedAvg's weights) or equally."""
    concurrency: int | None = Field(default=None, ge=1)
    """Clients training at once (null: train.clients_per_round, else every training client)."""
    speeds: SpeedsConfig | None = None
    """The clients' speeds (null: all equal; with kind none: no clock is kept)."""
