"""The ``privacy`` section of a run config (docs/privacy.md)."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, model_validator

from fedloom.core.settings import StrictModel


class AdaptiveClipConfig(StrictModel):
    """Adaptive clipping (Andrew et al., "Differentially Private Learning with Adaptive
    Clipping", NeurIPS 2021): the bound follows the ``target_quantile`` of the clients' update
    norms, C <- C exp(-lr (b - target_quantile)), b the noised fraction of updates within C."""

    target_quantile: float = Field(default=0.5, gt=0.0, lt=1.0)
    lr: float = Field(default=0.2, gt=0.0)
    count_noise: float | None = Field(default=None, ge=0.0)
    """Std of the noise on the count of clipped updates (null: expected clients per round /
    20, the paper's choice); part of the privacy budget (docs/privacy.md)."""


class PrivacyConfig(StrictModel):
    """Differential privacy (docs/privacy.md).

    - ``client_dp``: DP-FedAvg (McMahan et al. 2018): each client's model update clipped to L2
      norm ``clip``, Gaussian noise of std ``noise_multiplier * clip`` on their sum, divided by
      the expected number of clients per round; accounted with Opacus as ``rounds`` steps of
      the subsampled Gaussian mechanism.
    - ``sample_dp``: DP-SGD inside every client (Abadi et al. 2016, Opacus's semantics):
      Poisson minibatches of expected size ``train.batch_size``, each per-sample gradient
      clipped to L2 norm ``clip``, Gaussian noise of std ``noise_multiplier * clip`` on their
      sum; each client's steps accounted with Opacus, the largest epsilon reported.
    - ``distributed_dp``: the distributed discrete Gaussian (Kairouz, Liu, Steinke 2021): each
      client clips its update to L2 norm ``clip``, rotates, rounds it to the grid of scale
      ``gamma``, adds its share of discrete Gaussian noise and reduces it modulo 2^``bits``
      before secure aggregation (secagg or secagg_plus) sums it; the sum carries noise of std
      ``noise_multiplier * clip`` even though the server never sees one update. Accounted with
      the paper's bound for sums of discrete Gaussians (privacy/ddg_accounting.py)."""

    kind: Literal["none", "client_dp", "sample_dp", "distributed_dp"] = "none"
    noise_multiplier: float | None = Field(default=None, ge=0.0)
    target_epsilon: float | None = Field(default=None, gt=0.0)
    """Instead of ``noise_multiplier``: the smallest noise that keeps epsilon at the last round
    within this (Opacus's ``get_noise_multiplier``)."""
    clip: float = Field(default=1.0, gt=0.0)
    """client_dp: the bound S on each client's update (with ``adaptive_clip``: its first
    value); sample_dp: the bound C on each per-sample gradient."""
    adaptive_clip: AdaptiveClipConfig | None = None
    """client_dp only."""
    delta: float = Field(default=1e-5, gt=0.0, lt=1.0)
    accountant: Literal["rdp", "prv"] = "rdp"
    sampling: Literal["poisson", "fixed"] = "poisson"
    """client_dp: how the clients of a round are drawn: each training client independently
    with probability q = train.clients_per_round / clients (what the accountant assumes), or
    exactly train.clients_per_round of them (the accountant's q = m / N is then the usual
    approximation). sample_dp always draws Poisson minibatches and leaves client sampling as
    train sets it."""
    bits: int = Field(default=16, ge=2, le=32)
    """distributed_dp: b, each coordinate's bits: the sum is computed modulo 2^b."""
    beta: float = Field(default=math.exp(-0.5), ge=0.0, lt=1.0)
    """distributed_dp: conditional rounding's bound (0: unconditional; the paper's
    exp(-1/2))."""
    gamma: float | None = Field(default=None, gt=0.0)
    """distributed_dp: the grid's scale (null: k_stddevs standard deviations of the sum fill
    the 2^bits values, the paper's Section 4.4)."""
    k_stddevs: float = Field(default=4.0, gt=0.0)
    """distributed_dp: the standard deviations of the sum that the modular range holds when
    gamma is derived."""
    dropout_share: float = Field(default=0.0, ge=0.0, lt=1.0)
    """distributed_dp: the share of a round's clients that may drop out with the sum still
    carrying the target noise: each client adds 1 / (n - floor(share n)) of the variance."""

    @model_validator(mode="after")
    def _complete(self) -> PrivacyConfig:
        if self.kind == "none":
            return self
        if (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("set exactly one of noise_multiplier and target_epsilon")
        if self.kind == "sample_dp" and self.adaptive_clip is not None:
            raise ValueError("adaptive_clip applies to kind client_dp only")
        if self.kind == "distributed_dp" and self.adaptive_clip is not None:
            raise ValueError("adaptive_clip applies to kind client_dp only")
        if self.kind == "distributed_dp" and self.accountant != "rdp":
            raise ValueError(
                "accountant: distributed_dp is accounted with the paper's RDP bound (rdp)"
            )
        fields = type(self).model_fields
        for key in ("bits", "beta", "gamma", "k_stddevs", "dropout_share"):
            if self.kind != "distributed_dp" and getattr(self, key) != fields[key].default:
                raise ValueError(f"{key} applies to kind distributed_dp, not {self.kind}")
        return self
