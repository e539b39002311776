"""Client-level DP-FedAvg (McMahan et al., "Learning Differentially Private Recurrent Language
Models", ICLR 2018, Algorithm 1 with the fixed-denominator estimator).

Each round t, with q the sampling rate and S the clipping bound:

    client k (sampled):  Delta_k = w_k - theta_t;  Delta_k <- Delta_k min(1, S / ||Delta_k||)
    server:              theta_{t+1} = theta_t + (sum_k Delta_k + N(0, z^2 S^2 I)) / (q N)

||.|| is the L2 norm over all parameters; every client weighs 1 (the paper's w_k = 1); q N is
the expected number of clients per round (``train.clients_per_round``). The mechanism is the
subsampled Gaussian with noise multiplier z, once per round: Opacus accounts for it
(``accounting.epsilon``). The noise of round t is drawn from the stream (seed, round t,
'dp/noise'), so a resumed run adds the same noise as an uninterrupted one.

With ``adaptive_clip`` (Andrew et al., NeurIPS 2021, Algorithm 1) the bound moves each round
toward the target quantile gamma of the update norms:

    b_k = 1[||Delta_k|| <= C_t];   b = (sum_k b_k + N(0, sigma_b^2)) / (q N)
    C_{t+1} = C_t exp(-eta_C (b - gamma))

and the updates' noise multiplier becomes z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2), so that the
two releases together are one Gaussian mechanism of multiplier z (the paper's Theorem 1): the
accountant keeps counting z. C_t is part of the run's checkpointed state.

Threat model (docs/privacy.md): central DP with a trusted server, which sees each clipped
update; the released models (and everything derived from them) are (epsilon, delta)-DP at the
client level. Models with buffers (BatchNorm statistics) are refused: their averages would be
released without noise.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from fedloom.core.mechanism import Aggregator, Mechanism, UpdateSum
from fedloom.core.protocol import Message
from fedloom.core.rng import generator
from fedloom.errors import ConfigError
from fedloom.privacy.accounting import epsilon, noise_multiplier_for
from fedloom.privacy.config import PrivacyConfig

Tree = dict[str, torch.Tensor]


def sum_updates(trees: Sequence[Mapping[str, torch.Tensor]], anchor: Tree) -> Tree:
    """sum_k (tree_k - anchor) per key, in float64, in the clear."""
    out: Tree = {}
    for key, base in anchor.items():
        total = torch.zeros(base.shape, dtype=torch.float64)
        for tree in trees:
            total += tree[key].double() - base.double()
        out[key] = total
    return out


def update_norm(params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor]) -> float:
    """||params - anchor||, the L2 norm over all tensors (in float64)."""
    return math.sqrt(
        sum(float((params[k].double() - anchor[k].double()).pow(2).sum()) for k in anchor)
    )


def clip_update(
    params: Mapping[str, torch.Tensor],
    anchor: Mapping[str, torch.Tensor],
    bound: float,
    norm: float | None = None,
) -> Tree:
    """anchor + (params - anchor) min(1, bound / ||params - anchor||) (``norm``: that norm,
    when the caller has it already).

    An update within the bound is returned as it came, not recomputed as anchor + (params -
    anchor) * 1: in float32 that round trip rounds twice (the difference, then the sum) and is
    not exact where the model moved far from the anchor relative to its size (a parameter
    leaving 0), so a client's model moved by a unit in the last place there, and a run whose
    bound never binds (noise 0) strayed from FedAvg's average by more than the aggregation's
    own round-off (tests/privacy/test_client_dp_equals_fedavg.py)."""
    norm = update_norm(params, anchor) if norm is None else norm
    if norm <= bound:
        return {k: params[k] for k in anchor}
    factor = bound / norm
    return {k: anchor[k] + (params[k] - anchor[k]) * factor for k in anchor}


def update_noise_multiplier(z: float, count_noise: float) -> float:
    """z_Delta = (z^-2 - (2 sigma_b)^-2)^(-1/2) (Andrew et al. 2021, Theorem 1): the updates'
    share of a total noise multiplier z when the clipped count carries noise sigma_b."""
    if z == 0.0:
        return 0.0
    rest = z**-2 - (2.0 * count_noise) ** -2 if count_noise > 0 else -1.0
    if rest <= 0.0:
        raise ConfigError(
            f"privacy.adaptive_clip.count_noise: {count_noise:g} is too small for "
            f"noise_multiplier {z:g}: it must exceed noise_multiplier / 2"
        )
    return rest**-0.5


class ClientLevelDP(Mechanism):
    """The mechanism of one run (core/mechanism.py): each upload clipped (``on_upload``), the
    server's aggregation rule (``aggregate``, over the composed sum of updates: in the clear or
    secure aggregation's) and the accountant (``privacy_spent``)."""

    key = "privacy"

    def __init__(
        self, config: PrivacyConfig, seed: int, num_clients: int, per_round: int, rounds: int
    ) -> None:
        self.config = config
        self.seed = seed
        self.sample_rate = per_round / num_clients
        self.expected_clients = float(per_round)
        self.rounds = rounds
        if config.noise_multiplier is not None:
            self.noise_multiplier = float(config.noise_multiplier)
        else:
            assert config.target_epsilon is not None
            self.noise_multiplier = noise_multiplier_for(
                config.target_epsilon, config.delta, self.sample_rate, rounds, config.accountant
            )
        self.clip = float(config.clip)
        """The current bound C_t (moves with adaptive clipping)."""
        adaptive = config.adaptive_clip
        self.count_noise = 0.0
        self.update_multiplier = self.noise_multiplier
        if adaptive is not None:
            self.count_noise = (
                adaptive.count_noise if adaptive.count_noise is not None else per_round / 20.0
            )
            self.update_multiplier = update_noise_multiplier(
                self.noise_multiplier, self.count_noise
            )
        self.round = 0
        self.anchor: Tree | None = None
        self.update_sum: UpdateSum | None = None
        """How sum_k Delta_k is computed (None: in the clear; secure aggregation's
        ``sum_updates`` when the run has it: the server then sees only the sum)."""
        self._released = -1
        self._within: list[bool] = []

    # -- the round ------------------------------------------------------------------------
    def start_round(self, round: int, message: Message) -> None:
        """The model the round's updates are measured from: the broadcast ``params``."""
        self.round = round
        self.anchor = message["params"]
        self._within = []

    def on_upload(self, upload: Message, client_id: int, round: int) -> Message:
        return self.clip_upload(upload, client_id, round)

    def wrap_aggregate(self, inner: Aggregator, update_sum: UpdateSum | None) -> Aggregator:
        """The noised estimator replaces the mean; ``update_sum`` is how it sums."""
        self.update_sum = update_sum
        return self.aggregate

    def clip_upload(self, upload: Message, client_id: int, round: int) -> Message:
        """Clip the client's update (its uploaded model minus the broadcast one) to C_t; note
        whether it was within C_t (adaptive clipping's count)."""
        assert self.anchor is not None, "start_round first"
        params = upload["params"]
        norm = update_norm(params, self.anchor)
        self._within.append(norm <= self.clip)
        return {**upload, "params": clip_update(params, self.anchor, self.clip, norm)}

    def aggregate(
        self, trees: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
    ) -> Tree:
        """theta_t + (sum_k Delta_k + N(0, z^2 S^2 I)) / (q N) from the clipped models; the
        weights are ignored (every client weighs 1)."""
        anchor = self.anchor
        assert anchor is not None, "start_round first"
        if not trees or set(trees[0]) != set(anchor):
            raise ConfigError(
                "privacy.kind client_dp: the server averaged something other than the clients' "
                "models; use an algorithm whose server step is a model average"
            )
        if self._released == self.round:
            raise ConfigError(
                f"privacy.kind client_dp: the server averaged twice in round {self.round}; "
                "each release needs its own accounting"
            )
        self._released = self.round
        totals = (self.update_sum or sum_updates)(trees, anchor)
        gen = generator(self.seed, "dp/noise", self.round)
        std = self.update_multiplier * self.clip
        out: Tree = {}
        for key in sorted(anchor):
            base = anchor[key]
            total = totals[key].double()
            if std > 0:
                total = total + std * torch.randn(base.shape, generator=gen, dtype=torch.float64)
            out[key] = (base.double() + total / self.expected_clients).to(base.dtype)
        self._adapt_clip()
        return {k: out[k] for k in anchor}

    def _adapt_clip(self) -> None:
        """C_{t+1} = C_t exp(-eta_C (b - gamma)), b the noised fraction within C_t."""
        adaptive = self.config.adaptive_clip
        if adaptive is None:
            return
        gen = generator(self.seed, "dp/clip_count", self.round)
        noise = self.count_noise * float(torch.randn((), generator=gen, dtype=torch.float64))
        fraction = (sum(self._within) + noise) / self.expected_clients
        self.clip *= math.exp(-adaptive.lr * (fraction - adaptive.target_quantile))

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: the current bound."""
        return {"clip": self.clip}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.clip = float(saved["clip"])

    # -- accounting -----------------------------------------------------------------------
    def privacy_spent(self) -> dict[str, Any]:
        """Epsilon after the rounds so far (one subsampled Gaussian step per round; null, as
        JSON has no infinity, when no noise is added), and the current bound."""
        cfg = self.config
        history = [(self.noise_multiplier, self.sample_rate, self.round)]
        spent = epsilon(history, cfg.delta, cfg.accountant)
        return {
            "epsilon": spent if math.isfinite(spent) else None,
            "delta": cfg.delta,
            "clip": self.clip,
        }

    def summary(self) -> dict[str, Any]:
        """summary.json's ``privacy`` section."""
        return {
            **self.privacy_spent(),
            "kind": "client_dp",
            "accountant": self.config.accountant,
            "noise_multiplier": self.noise_multiplier,
            "update_noise_multiplier": self.update_multiplier,
            "adaptive_clip": self.config.adaptive_clip is not None,
            "sample_rate": self.sample_rate,
            "sampling": self.config.sampling,
            "steps": self.round,
        }
