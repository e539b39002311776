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

from fedloom.config import PrivacyConfig
from fedloom.core.protocol import Message
from fedloom.core.rng import generator
from fedloom.errors import ConfigError
from fedloom.privacy.accounting import epsilon, noise_multiplier_for

Tree = dict[str, torch.Tensor]


def clip_update(
    params: Mapping[str, torch.Tensor], anchor: Mapping[str, torch.Tensor], bound: float
) -> Tree:
    """anchor + (params - anchor) min(1, bound / ||params - anchor||), the norm over all
    tensors (in float64)."""
    delta = {k: params[k] - anchor[k] for k in anchor}
    norm = math.sqrt(sum(float(d.double().pow(2).sum()) for d in delta.values()))
    factor = 1.0 if norm <= bound else bound / norm
    return {k: anchor[k] + d * factor for k, d in delta.items()}


class ClientLevelDP:
    """The mechanism of one run: an upload transform (``clip_upload``), the server's
    aggregation rule (``aggregate``) and the accountant (``privacy_spent``)."""

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
        self.round = 0
        self.anchor: Tree | None = None
        self._released = -1

    # -- the round ------------------------------------------------------------------------
    def start_round(self, round: int, message: Message) -> None:
        """The model the round's updates are measured from: the broadcast ``params``."""
        self.round = round
        self.anchor = message["params"]

    def clip_upload(self, upload: Message, client_id: int, round: int) -> Message:
        """Clip the client's update (its uploaded model minus the broadcast one) to ``clip``."""
        assert self.anchor is not None, "start_round first"
        return {**upload, "params": clip_update(upload["params"], self.anchor, self.config.clip)}

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
        gen = generator(self.seed, "dp/noise", self.round)
        std = self.noise_multiplier * self.config.clip
        out: Tree = {}
        for key in sorted(anchor):
            base = anchor[key]
            total = torch.zeros(base.shape, dtype=torch.float64)
            for tree in trees:
                total += tree[key].double() - base.double()
            if std > 0:
                total += std * torch.randn(base.shape, generator=gen, dtype=torch.float64)
            out[key] = (base.double() + total / self.expected_clients).to(base.dtype)
        return {k: out[k] for k in anchor}

    # -- accounting -----------------------------------------------------------------------
    def privacy_spent(self) -> dict[str, Any]:
        """Epsilon after the rounds so far (one subsampled Gaussian step per round)."""
        cfg = self.config
        history = [(self.noise_multiplier, self.sample_rate, self.round)]
        return {"epsilon": epsilon(history, cfg.delta, cfg.accountant), "delta": cfg.delta}

    def summary(self) -> dict[str, Any]:
        """summary.json's ``privacy`` section."""
        return {
            **self.privacy_spent(),
            "kind": "client_dp",
            "accountant": self.config.accountant,
            "noise_multiplier": self.noise_multiplier,
            "clip": self.config.clip,
            "sample_rate": self.sample_rate,
            "sampling": self.config.sampling,
            "steps": self.round,
        }
