"""The run's mechanisms, built once from the config and composed in one declared order
(``ORDER``): poisoning attacks (``attack``), compression (``compression``), secure aggregation
(``secure_aggregation``), robust or feature-aware aggregation (``aggregator``), differential
privacy (``privacy``), then contribution evaluation and incentives (engine/contribution.py).
Each implements the mechanism protocol (core/mechanism.py); the round pipeline
(engine/pipeline.py) calls :class:`Mechanisms`, which calls every hook of every mechanism in
that order and knows none of them by type.

The order is what makes the compositions right: an attacker crafts its upload before DP clips
it (``on_upload``); secure aggregation's masked sum is what client-level DP noises
(``wrap_sum``, then DP's ``wrap_aggregate`` outermost); a robust rule replaces the mean of the
uploads as compression's server decoded them (``on_send`` comes before any server step). The
config's rules (config.py) exclude the pairs that do not compose (a robust rule needs the
uploads in the clear, so not with secure aggregation or client-level DP)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedloom.algorithms import ALGORITHMS
from fedloom.attacks.mechanism import Attack
from fedloom.compression.mechanism import Compression
from fedloom.config import RunConfig
from fedloom.core.mechanism import Aggregator, Mechanism, MechanismChain, UploadTransform
from fedloom.data.federated import FederatedData
from fedloom.data.missing import observed
from fedloom.engine.sampling import POOLED_CLIENT
from fedloom.engine.workload import most_steps
from fedloom.errors import ConfigError
from fedloom.privacy import ClientLevelDP, DistributedDP, SampleLevelDP
from fedloom.robust.aggregation import RobustAggregation
from fedloom.robust.feature_aware import FeatureAwareAggregation, first_layer_key
from fedloom.secure.aggregation import SecureAggregation, build_protocol

ORDER = ("attack", "compression", "secure", "robust", "privacy")
"""The built-in mechanisms' keys in the order every hook runs; a caller's (contribution and
incentives) come after them."""

__all__ = ["ORDER", "Aggregator", "Mechanisms", "UploadTransform"]


class Mechanisms(MechanismChain):
    """The mechanisms one run's config asks for, in ``ORDER`` (``all``), and the hooks of the
    round pipeline over all of them (core/mechanism.py). ``privacy`` and ``secure`` name the
    ones that were built (None when off) for the callbacks that report them."""

    def __init__(
        self,
        config: RunConfig,
        data: FederatedData,
        module: torch.nn.Module,
        train_ids: Sequence[int],
        extra: Sequence[Mechanism] = (),
    ) -> None:
        self.config = config
        self.train_ids = list(train_ids)
        per_round = config.train.clients_per_round or len(self.train_ids)
        attack = (
            Attack(config.attack, config.seed, self.train_ids, per_round)
            if config.attack.kind != "none"
            else None
        )
        self.malicious: list[int] = attack.malicious if attack is not None else []
        self.data = attack.poisoned(data) if attack is not None else data
        """The data the clients train on: the malicious clients' poisoned (data attacks)."""
        buffers = [n for n, _ in module.named_buffers()]
        self.sample_dp = self._sample_dp(buffers)
        """Sample-level DP's settings for the client programs (None when off)."""
        self.privacy: Mechanism | None = self.sample_dp or self._client_dp(buffers)
        self.secure = self._secure(buffers)
        if self.secure is not None and config.privacy.kind == "distributed_dp":
            train = config.train  # noise added by the clients, summed by secure aggregation
            self.privacy = DistributedDP(
                config.privacy, config.seed, len(self.train_ids), train.clients_per_round,
                train.rounds, self.secure,
            )  # fmt: skip
        compression = config.compression
        built: dict[str, Mechanism | None] = {
            "attack": attack,
            "compression": (
                Compression(compression, config.seed)
                if compression.kind != "none" or compression.download != "none"
                else None
            ),
            "secure": self.secure,
            "robust": self._robust(module, per_round),
            "privacy": self.privacy,
        }
        super().__init__([*(m for m in (built[key] for key in ORDER) if m is not None), *extra])

    @property
    def poisson_clients(self) -> bool:
        """Whether clients are drawn by Poisson sampling (client-level DP's accounting)."""
        privacy = self.config.privacy
        return privacy.kind in ("client_dp", "distributed_dp") and privacy.sampling == "poisson"

    # -- construction ----------------------------------------------------------------------
    def _releasable(self, buffers: list[str]) -> None:
        if buffers:
            raise ConfigError(
                f"privacy.kind: {self.config.privacy.kind} cannot release the model's buffers "
                f"({', '.join(buffers)}) without noise: use a model without normalization "
                "statistics"
            )

    def _sample_dp(self, buffers: list[str]) -> SampleLevelDP | None:
        cfg, train = self.config, self.config.train
        if cfg.privacy.kind != "sample_dp":
            return None
        self._releasable(buffers)
        population = {c: self.data.clients[c].num_train for c in self.train_ids}
        if ALGORITHMS.get(cfg.algorithm.name).capabilities.pooled:  # one virtual client of all data
            population = {POOLED_CLIENT: sum(population.values())}
        most = {c: most_steps(train, c, n) * train.rounds for c, n in population.items()}
        return SampleLevelDP(cfg.privacy, population, train.batch_size, most)

    def _client_dp(self, buffers: list[str]) -> ClientLevelDP | None:
        cfg, train = self.config, self.config.train
        if cfg.privacy.kind != "client_dp":
            return None
        self._releasable(buffers)
        assert train.clients_per_round is not None  # checked when parsed
        return ClientLevelDP(
            cfg.privacy, cfg.seed, len(self.train_ids), train.clients_per_round, train.rounds
        )

    def _robust(
        self, module: torch.nn.Module, per_round: int
    ) -> RobustAggregation | FeatureAwareAggregation | None:
        cfg = self.config
        if cfg.aggregator.kind == "mean":
            return None
        if cfg.aggregator.kind == "feature_aware":  # masks: what each client observed
            key = first_layer_key(module, self.data.input_shape)
            return FeatureAwareAggregation(key, observed(self.data))
        return RobustAggregation(cfg.aggregator, cfg.seed, cfg.byzantine_f(per_round))

    def _secure(self, buffers: list[str]) -> SecureAggregation | None:
        cfg = self.config.secure_aggregation
        if cfg.kind == "none":
            return None
        if buffers:
            raise ConfigError(
                f"secure_aggregation.kind: {cfg.kind} sums one vector of parameters per client "
                f"and round; the model's buffers ({', '.join(buffers)}) would need a second sum:"
                " use a model without normalization statistics"
            )
        # a round holds at most every training client (Poisson sampling may exceed its mean)
        protocol = build_protocol(cfg, self.config.seed, max(2, len(self.train_ids)))
        return SecureAggregation(cfg, protocol)
