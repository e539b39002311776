"""The robust or feature-aware aggregation of a run from its ``aggregator`` section
(core/mechanism.py, ``Builder``)."""

from __future__ import annotations

from fedloom.core.mechanism import BuildFacts
from fedloom.data.missing import observed
from fedloom.robust.aggregation import RobustAggregation
from fedloom.robust.config import AggregatorConfig
from fedloom.robust.feature_aware import FeatureAwareAggregation, first_layer_key


def build(
    section: AggregatorConfig, facts: BuildFacts
) -> RobustAggregation | FeatureAwareAggregation | None:
    """A Byzantine-robust rule tolerating ``facts.byzantine_f`` clients (docs/security.md), or
    the missing-feature-aware mean over what each client observed (docs/missing_features.md);
    None for the plain mean."""
    if section.kind == "mean":
        return None
    if section.kind == "feature_aware":
        assert facts.module is not None and facts.data is not None  # horizontal runs only
        key = first_layer_key(facts.module, facts.data.input_shape)
        return FeatureAwareAggregation(key, observed(facts.data))
    return RobustAggregation(section, facts.seed, facts.byzantine_f)
