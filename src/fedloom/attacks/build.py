"""The attack mechanism of a run from its ``attack`` section (core/mechanism.py, ``Builder``)."""

from __future__ import annotations

from fedloom.attacks.config import AttackConfig
from fedloom.attacks.mechanism import Attack
from fedloom.core.mechanism import BuildFacts


def build(section: AttackConfig, facts: BuildFacts) -> Attack | None:
    """A seeded fraction of the training clients attack (docs/security.md); None when off."""
    if section.kind == "none":
        return None
    return Attack(section, facts.seed, facts.train_ids, facts.per_round)
