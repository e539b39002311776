"""Greedy evaluation: mean undiscounted return of the argmax policy, ``episodes`` episodes per
(policy, environment) group, all groups as one batch."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from fedloom.rl.config import RLDataConfig
from fedloom.rl.envs import make_env
from fedloom.rl.policy_gradient import rollout


def label(data: RLDataConfig, value: float) -> str:
    return f"{data.variant_key}={value:g}"


@torch.no_grad()
def greedy_returns(
    data: RLDataConfig,
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    variants: Sequence[float],
    episodes: int,
    gen: torch.Generator,
) -> torch.Tensor:
    """Mean greedy return of group g (``logits_fn`` maps [G, episodes, d] to [G, episodes, A],
    group g's policy on its rows) in the environment ``variants[g]``; a tensor [G]."""
    env = make_env(data, variants, episodes)
    ep = rollout(env, logits_fn, len(variants), gen, greedy=True)
    return ep.returns.mean(1)


def by_environment(
    data: RLDataConfig, variants: Sequence[float], returns: torch.Tensor
) -> dict[str, dict[str, float]]:
    """``{"train": {label: mean}, "unseen": {...}}``: groups of the same environment averaged
    (local agents on an unseen environment: the mean over the agents)."""
    train, unseen = data.variants
    out: dict[str, dict[str, float]] = {"train": {}, "unseen": {}}
    for kind, values in (("train", train), ("unseen", unseen)):
        for v in dict.fromkeys(values):
            picks = [float(r) for g, r in zip(variants, returns, strict=True) if g == v]
            if picks:
                out[kind][label(data, v)] = sum(picks) / len(picks)
    return out
