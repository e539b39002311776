"""Distributed DP with the distributed discrete Gaussian and secure aggregation (Kairouz, Liu,
Steinke, "The Distributed Discrete Gaussian Mechanism for Federated Learning with Secure
Aggregation", ICML 2021, Algorithms 1 and 2).

Each round t, with n the nominal clients a round, z the noise multiplier and c the clip:

    every client k:  Delta_k = w_k - theta_t, encoded (ddg_codec.py): clipped to c, scaled by
                     1/gamma, rotated (random signs of the stream (seed, t, 'ddp/rotation'),
                     shared by the round's clients), conditionally rounded, plus discrete
                     Gaussian noise of variance sigma^2 = z^2 c^2 / (m gamma^2), modulo 2^b
    SecAgg/SecAgg+:  the sum modulo 2^32 of the vectors of the clients that upload
    server:          theta_{t+1} = theta_t + decode(sum) / n_t

with m = n - floor(dropout_share n) (the survivors the noise is planned for: as long as at
least m clients' shares are in the sum, it carries variance >= z^2 c^2 / gamma^2) and n_t the
clients in the round's sum (every client weighs 1). The accountant (ddg_accounting.py) counts
each round with the number of noise shares actually in its sum, so rounds that lose more
clients than planned (train.dropout) cost more epsilon, and none is hidden.

Threat model (docs/privacy.md): an honest-but-curious server that sees only secure
aggregation's sum; every released model is (epsilon, delta)-DP at the client level without
trusting it with any single update. The clients' steps are simulated at the server's sum,
each client with its own streams (seed, t, client, 'ddp/round' and 'ddp/noise').
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch

from fedloom.core.mechanism import Aggregator, Mechanism, ServerStep, UpdateSum
from fedloom.core.protocol import Message
from fedloom.core.pytree import flatten64, unflatten
from fedloom.core.rng import numpy_rng
from fedloom.errors import ConfigError
from fedloom.privacy.config import PrivacyConfig
from fedloom.privacy.ddg_accounting import DDGAccount, Grid, grid_scale
from fedloom.privacy.ddg_codec import DDGCodec
from fedloom.privacy.discrete_gaussian import LARGEST_VARIANCE, as_variance
from fedloom.privacy.rotation import padded, signs

Tree = dict[str, torch.Tensor]

_NOT_SENT = ("keys", "shares")
"""Secure aggregation's drop stages before a client's masked input leaves it."""


@runtime_checkable
class IntegerSum(Protocol):
    """Secure aggregation's integer sum (secure/aggregation.py, SecAgg and SecAgg+): the sum
    modulo 2^32 of the round's clients' uint32 vectors and how many clients it holds."""

    def sum_integers(self, inputs: Mapping[int, np.ndarray]) -> tuple[np.ndarray, int]: ...


def planned_shares(clients: int, share: float) -> int:
    """m = n - floor(share n): the noise shares a round's sum is planned to hold."""
    return max(1, clients - math.floor(share * clients))


class DistributedDP(Mechanism):
    """The mechanism of one run (core/mechanism.py): the round's clients (``before_aggregate``),
    the encoded sum through secure aggregation and the server's decoding (``aggregate``), the
    accountant (``privacy_spent``). The model's size is read from the first broadcast."""

    key = "privacy"

    def __init__(
        self,
        config: PrivacyConfig,
        seed: int,
        num_clients: int,
        per_round: int | None,
        rounds: int,
        secure: IntegerSum,
    ) -> None:
        self.config = config
        self.seed = seed
        self.clients_per_round = per_round or num_clients
        self.q = self.clients_per_round / num_clients
        self.rounds = rounds
        self.secure = secure
        self.planned = planned_shares(self.clients_per_round, config.dropout_share)
        self.noise_multiplier = config.noise_multiplier
        self.codec: DDGCodec | None = None
        self.account: DDGAccount | None = None
        self.round = 0
        self.anchor: Tree | None = None
        self.clients: list[int] = []
        self.drops: dict[int, Any] = {}
        self.shares: dict[int, int] = {}
        """Rounds released so far by the noise shares in their sum (the accountant's input;
        checkpointed)."""
        self._released = -1

    # -- settings -------------------------------------------------------------------------
    def setup(self, dim: int) -> None:
        """Fix gamma, the local variance and the noise multiplier (from target_epsilon, by
        bisection on the paper's accountant) for a model of ``dim`` parameters."""
        cfg = self.config
        rotated = padded(dim)
        z = self.noise_multiplier
        if z is None:
            assert cfg.target_epsilon is not None
            z = self._calibrate(cfg.target_epsilon, dim)
        self.noise_multiplier = z
        self.codec, self.account = self._settings(z, dim, rotated)

    def _settings(self, z: float, dim: int, rotated: int) -> tuple[DDGCodec, DDGAccount]:
        cfg = self.config
        std = z * cfg.clip / math.sqrt(self.planned)
        gamma = cfg.gamma or grid_scale(
            std, cfg.clip, cfg.bits, self.clients_per_round, rotated, cfg.k_stddevs
        )
        # a grid finer than std / 4096 buys nothing (rounding is 2^-26 of the noise variance)
        gamma = max(gamma, std / math.sqrt(LARGEST_VARIANCE))
        variance = as_variance((std / gamma) ** 2) if z > 0 else Fraction(0)
        grid = Grid(cfg.clip, gamma, cfg.beta, rotated)
        codec = DDGCodec(grid, variance, cfg.bits, dim)
        account = DDGAccount(grid, float(variance), self.q)
        return codec, account

    def _epsilon_at(self, z: float, dim: int) -> float:
        _, account = self._settings(z, dim, padded(dim))
        return account.epsilon({self.planned: self.rounds}, self.config.delta)

    def _calibrate(self, target: float, dim: int) -> float:
        """The smallest z (to 0.1%) whose planned rounds stay within ``target``."""
        low, high = 0.0, 1.0
        while self._epsilon_at(high, dim) > target:
            low, high = high, high * 2
            if high > 1e4:
                raise ConfigError(
                    f"privacy.target_epsilon: {target:g} is out of reach (noise multiplier "
                    f"beyond 10^4); raise it or privacy.bits"
                )
        while high - low > 1e-3 * high:
            mid = (low + high) / 2
            low, high = (low, mid) if self._epsilon_at(mid, dim) <= target else (mid, high)
        return high

    # -- the round ------------------------------------------------------------------------
    def start_round(self, round: int, message: Message) -> None:
        self.round = round
        self.anchor = message["params"]
        if self.codec is None:
            self.setup(sum(t.numel() for t in self.anchor.values()))

    def before_aggregate(self, step: ServerStep) -> None:
        self.clients = [r.client_id for r in step.results]
        self.drops = dict(step.drops)

    def wrap_aggregate(self, inner: Aggregator, update_sum: UpdateSum | None) -> Aggregator:
        """The decoded secure sum replaces the mean."""
        return self.aggregate

    def aggregate(
        self, trees: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]
    ) -> Tree:
        """theta_t + decode(sum of the encoded updates) / n_t; the weights are ignored."""
        anchor, codec = self.anchor, self.codec
        assert anchor is not None and codec is not None, "start_round first"
        if not trees or set(trees[0]) != set(anchor) or len(trees) != len(self.clients):
            raise ConfigError(
                "privacy.kind distributed_dp: the server averaged something other than the "
                "round's clients' models; use an algorithm whose server step is a model average"
            )
        if self._released == self.round:
            raise ConfigError(
                f"privacy.kind distributed_dp: the server averaged twice in round {self.round}; "
                "each release needs its own accounting"
            )
        keys = list(anchor)
        base = flatten64(anchor, keys).numpy()
        diagonal = signs(codec.grid.dim, numpy_rng(self.seed, "ddp/rotation", self.round))
        inputs = {
            c: codec.encode(
                flatten64(tree, keys).numpy() - base,
                diagonal,
                numpy_rng(self.seed, "ddp/round", self.round, c),
                numpy_rng(self.seed, "ddp/noise", self.round, c),
            )
            for c, tree in zip(self.clients, trees, strict=True)
            if self.drops.get(c) not in _NOT_SENT
        }
        total, included = self.secure.sum_integers(inputs)
        self._released = self.round
        self.shares[included] = self.shares.get(included, 0) + 1
        if included == 0:
            return dict(anchor)
        mean = codec.decode(total, diagonal) / included
        return unflatten(torch.from_numpy(base + mean), anchor, keys)

    def state_dict(self) -> dict[str, Any]:
        """What a resumed run needs: the rounds released by noise shares."""
        return {"shares": {str(k): v for k, v in sorted(self.shares.items())}}

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.shares = {int(k): int(v) for k, v in saved["shares"].items()}

    # -- accounting -----------------------------------------------------------------------
    def privacy_spent(self) -> dict[str, Any]:
        """Epsilon after the rounds so far (null, as JSON has no infinity, without noise)."""
        spent = self.account.epsilon(self.shares, self.config.delta) if self.account else 0.0
        return {
            "epsilon": spent if math.isfinite(spent) else None,
            "delta": self.config.delta,
            "clip": self.config.clip,
        }

    def summary(self) -> dict[str, Any]:
        """summary.json's ``privacy`` section."""
        codec = self.codec
        out: dict[str, Any] = {
            **self.privacy_spent(),
            "kind": "distributed_dp",
            "noise_multiplier": self.noise_multiplier,
            "sample_rate": self.q,
            "sampling": self.config.sampling,
            "steps": sum(self.shares.values()),
            "planned_shares": self.planned,
            "shares": {str(k): v for k, v in sorted(self.shares.items())},
        }
        if codec is not None:
            out |= {
                "bits": codec.bits,
                "gamma": codec.grid.gamma,
                "local_variance": float(codec.variance),
                "dimension": codec.grid.dim,
                "payload_bytes_per_client": math.ceil(codec.bits * codec.grid.dim / 8),
            }
        return out
