"""The environments of a run: K agents' training environments and the evaluation grid, as one
batch (environment ``g * per_variant + i`` is group g's i-th)."""

from __future__ import annotations

from collections.abc import Sequence

from fedloom.rl.cartpole import CartPoleBatch, CartPoleParams
from fedloom.rl.config import RLDataConfig
from fedloom.rl.gym_vector import GymVector
from fedloom.rl.policy_gradient import VecEnv


def make_env(data: RLDataConfig, variants: Sequence[float], per_variant: int) -> VecEnv:
    """``per_variant`` environments for each value of the varied physics parameter."""
    values = [v for v in variants for _ in range(per_variant)]
    if data.name == "cartpole":
        c = data.cartpole
        return CartPoleBatch(CartPoleParams.make(values, c.masspole, c.masscart, c.gravity))
    return GymVector("Acrobot-v1", [{"LINK_MASS_2": v} for v in values])


def agent_variants(data: RLDataConfig) -> list[float]:
    """Agent k's environment: the k-th training value, cycling."""
    train, _ = data.variants
    return [train[k % len(train)] for k in range(data.num_clients)]
