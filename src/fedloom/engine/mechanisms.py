"""The mechanisms of a horizontal run, built once from the config by the one builder
(engine/mechanism_builders.py, in its declared order ``ORDER``), then contribution evaluation
and incentives (engine/contribution.py). Each implements the mechanism protocol
(core/mechanism.py); the round pipeline (engine/pipeline.py) calls :class:`Mechanisms`, which
calls every hook of every mechanism in that order and knows none of them by type."""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

import torch

from fedloom.algorithms import ALGORITHMS
from fedloom.attacks.mechanism import Attack
from fedloom.config import RunConfig
from fedloom.core.mechanism import BuildFacts, Mechanism, MechanismChain
from fedloom.data.federated import FederatedData
from fedloom.engine.mechanism_builders import build_mechanisms
from fedloom.engine.sampling import POOLED_CLIENT
from fedloom.engine.workload import most_steps
from fedloom.privacy import SampleLevelDP
from fedloom.secure.aggregation import SecureAggregation

__all__ = ["Mechanisms"]


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
        facts = build_mechanisms(config, self._facts(data, module))
        built = facts.built  # by key, each built by its package's builder
        attack = cast(Attack | None, built.get("attack"))
        self.malicious: list[int] = attack.malicious if attack is not None else []
        assert facts.data is not None
        self.data = facts.data
        """The data the clients train on: the malicious clients' poisoned (data attacks)."""
        self.privacy: Mechanism | None = built.get("privacy")
        self.sample_dp = (
            cast(SampleLevelDP, self.privacy) if config.privacy.kind == "sample_dp" else None
        )
        """Sample-level DP's settings for the client programs (None when off)."""
        self.secure = cast(SecureAggregation | None, built.get("secure"))
        super().__init__([*facts.built.values(), *extra])

    def _facts(self, data: FederatedData, module: torch.nn.Module) -> BuildFacts:
        """What the builders read of this run (core/mechanism.py)."""
        config, train = self.config, self.config.train
        per_round = train.clients_per_round or len(self.train_ids)
        pooled = ALGORITHMS.get(config.algorithm.name).capabilities.pooled

        def run_steps(client: int, n: int) -> int:
            return most_steps(train, client, n) * train.rounds

        return BuildFacts(
            seed=config.seed,
            train_ids=tuple(self.train_ids),
            clients_per_round=train.clients_per_round,
            rounds=train.rounds,
            byzantine_f=config.byzantine_f(per_round),
            buffers=tuple(name for name, _ in module.named_buffers()),
            module=module,
            data=data,
            batch_size=train.batch_size,
            pooled_client=POOLED_CLIENT if pooled else None,
            run_steps=run_steps,
        )

    @property
    def poisson_clients(self) -> bool:
        """Whether clients are drawn by Poisson sampling (client-level DP's accounting)."""
        privacy = self.config.privacy
        return privacy.kind in ("client_dp", "distributed_dp") and privacy.sampling == "poisson"
