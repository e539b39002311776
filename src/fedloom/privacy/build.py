"""The differential privacy mechanism of a run from its ``privacy`` section
(core/mechanism.py, ``Builder``): sample-level DP-SGD, client-level DP-FedAvg, or distributed
DP noising secure aggregation's integer sum (docs/privacy.md)."""

from __future__ import annotations

from fedloom.core.mechanism import BuildFacts, Mechanism
from fedloom.errors import ConfigError
from fedloom.privacy.client_dp import ClientLevelDP
from fedloom.privacy.config import PrivacyConfig
from fedloom.privacy.distributed_dp import DistributedDP, IntegerSum
from fedloom.privacy.sample_dp import SampleLevelDP


def build(section: PrivacyConfig, facts: BuildFacts) -> Mechanism | None:
    """The mechanism ``privacy.kind`` names; None when off. Distributed DP is built over the
    secure aggregation built before it (the config's rules require one)."""
    if section.kind == "none":
        return None
    if section.kind == "distributed_dp":
        secure = facts.built.get("secure")
        if not isinstance(secure, IntegerSum):
            return None
        return DistributedDP(
            section, facts.seed, len(facts.train_ids), facts.per_round, facts.rounds, secure
        )
    if facts.buffers:
        raise ConfigError(
            f"privacy.kind: {section.kind} cannot release the model's buffers "
            f"({', '.join(facts.buffers)}) without noise: use a model without normalization "
            "statistics"
        )
    if section.kind == "sample_dp":
        return _sample_dp(section, facts)
    return ClientLevelDP(section, facts.seed, len(facts.train_ids), facts.per_round, facts.rounds)


def _sample_dp(section: PrivacyConfig, facts: BuildFacts) -> SampleLevelDP:
    """DP-SGD's settings for the client programs and their per-client accounting."""
    assert facts.data is not None and facts.run_steps is not None  # horizontal runs only
    population = {c: facts.data.clients[c].num_train for c in facts.train_ids}
    if facts.pooled_client is not None:  # one virtual client of all data
        population = {facts.pooled_client: sum(population.values())}
    most = {c: facts.run_steps(c, n) for c, n in population.items()}
    return SampleLevelDP(section, population, facts.batch_size, most)
