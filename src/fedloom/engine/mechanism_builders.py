"""The one builder of a run's mechanisms, for every run family: each mechanism package's
``build(section, facts)`` (core/mechanism.py, ``Builder``), called in the declared order
(``BUILDERS``): poisoning attacks, compression, secure aggregation, robust or feature-aware
aggregation, differential privacy. The horizontal engine (engine/mechanisms.py) and federated
RL's server step (rl/aggregate.py) both build theirs here (docs/architecture.md,
"Mechanisms").

The order is what makes the compositions right: an attacker crafts its upload before DP clips
it (``on_upload``); secure aggregation's masked sum is what DP noises (``wrap_sum``, then DP's
``wrap_aggregate`` outermost; distributed DP is built over the secure aggregation built before
it, ``BuildFacts.built``); a robust rule replaces the mean of the uploads as compression's
server decoded them (``on_send`` comes before any server step). The config's rules
(config.py ``RULES``, rl/config.py ``RL_RULES``) exclude the pairs that do not compose."""

from __future__ import annotations

from dataclasses import replace

from pydantic import BaseModel

from fedloom.attacks.build import build as build_attack
from fedloom.compression.build import build as build_compression
from fedloom.core.mechanism import Builder, BuildFacts
from fedloom.privacy.build import build as build_privacy
from fedloom.robust.build import build as build_robust
from fedloom.secure.build import build as build_secure

BUILDERS: tuple[tuple[str, str, Builder], ...] = (
    ("attack", "attack", build_attack),
    ("compression", "compression", build_compression),
    ("secure", "secure_aggregation", build_secure),
    ("robust", "aggregator", build_robust),
    ("privacy", "privacy", build_privacy),
)
"""(the mechanism's key, its config section, its builder), in the order every hook runs."""

ORDER = tuple(key for key, _, _ in BUILDERS)
"""The built-in mechanisms' keys in the order every hook runs; a caller's (contribution and
incentives) come after them."""


def build_mechanisms(config: BaseModel, facts: BuildFacts) -> BuildFacts:
    """``facts`` after every builder in ``BUILDERS`` order: ``built`` holds the mechanisms the
    config turns on (in that order), ``data`` the data the clients train on. A section the
    run family has not (RL runs have no ``attack`` or ``secure_aggregation``) builds none."""
    for key, section, build in BUILDERS:
        part = getattr(config, section, None)
        mechanism = build(part, facts) if part is not None else None
        if mechanism is not None:
            data = mechanism.train_data(facts.data) if facts.data is not None else None
            facts = replace(facts, built={**facts.built, key: mechanism}, data=data)
    return facts
