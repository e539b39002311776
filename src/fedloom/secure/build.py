"""The secure aggregation mechanism of a run from its ``secure_aggregation`` section
(core/mechanism.py, ``Builder``)."""

from __future__ import annotations

from fedloom.core.mechanism import BuildFacts
from fedloom.errors import ConfigError
from fedloom.secure.aggregation import SecureAggregation, build_protocol
from fedloom.secure.config import SecureAggregationConfig


def build(section: SecureAggregationConfig, facts: BuildFacts) -> SecureAggregation | None:
    """The protocol over the run's training clients (docs/secure_aggregation.md); None when
    off. ConfigError when the model has buffers (they would need a second sum)."""
    if section.kind == "none":
        return None
    if facts.buffers:
        raise ConfigError(
            f"secure_aggregation.kind: {section.kind} sums one vector of parameters per client "
            f"and round; the model's buffers ({', '.join(facts.buffers)}) would need a second "
            "sum: use a model without normalization statistics"
        )
    # a round holds at most every training client (Poisson sampling may exceed its mean)
    protocol = build_protocol(section, facts.seed, max(2, len(facts.train_ids)))
    return SecureAggregation(section, protocol)
