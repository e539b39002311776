"""Federated RL with client sampling and a robust rule (docs/rl.md, Client sampling): 2 of 4
agents per round from the seeded stream horizontal runs use, their update aggregated by a
``fedloom.robust`` rule; a poisoned agent moves the mean but not the median."""

from __future__ import annotations

import pytest
import torch

import fedloom
from fedloom.engine.sampling import sample_clients
from fedloom.errors import ConfigError
from fedloom.rl.aggregate import PolicyAggregator
from fedloom.rl.config import parse_rl_config


def _cfg(per_round: int | None, kind: str = "median") -> dict:
    return {
        "kind": "rl",
        "seed": 5,
        "data": {
            "name": "cartpole",
            "num_clients": 4,
            "envs_per_client": 2,
            "cartpole": {"lengths": [0.3, 0.5, 0.8, 1.0]},
        },
        "model": {"hidden": [8]},
        "algorithm": {"name": "pavg"},
        "train": {"rounds": 3, "local_steps": 1, "clients_per_round": per_round},
        "eval": {"every": 3, "episodes": 2},
        "aggregator": {"kind": kind},
    }


def aggregator(
    kind: str, seed: int, weights: list[float], per_round: int | None = None, **sections: dict
) -> PolicyAggregator:
    """The server step of a PAvg run over ``len(weights)`` agents."""
    cfg = parse_rl_config(
        {
            "kind": "rl",
            "seed": seed,
            "data": {"name": "cartpole", "num_clients": len(weights)},
            "algorithm": {"name": "pavg"},
            "train": {"clients_per_round": per_round},
            "aggregator": {"kind": kind},
            **sections,
        }
    )
    return PolicyAggregator(cfg, weights)


def test_two_of_four_with_a_robust_rule_samples_and_aggregates_as_composed():
    cfg = parse_rl_config(_cfg(2))
    result = fedloom.run(cfg, write=False)
    learner = result.extras["learner"]
    for r in range(3):
        assert learner.sampled(r) == sample_clients(5, r, [0, 1, 2, 3], 2)
        assert len(learner.sampled(r)) == 2
    assert len({tuple(learner.sampled(r)) for r in range(20)}) > 1  # not always the same
    size = sum(v.numel() * v.element_size() for v in learner.global_.values())
    assert result.summary["communication"]["bytes_up"] == 3 * 2 * size  # sampled uploads only
    assert result.summary["rl"]["aggregator"]["kind"] == "median"

    # the server step, composed by hand: the median of the two sampled agents' trees
    agg = aggregator("median", 5, [2.0] * 4, per_round=2)
    stacked = {"pi.w": torch.tensor([[0.0], [1.0], [100.0], [3.0]])}
    previous = {"pi.w": torch.tensor([0.0])}
    out, sent = agg(stacked, ["pi.w"], previous, 0, agents=[1, 3])
    assert torch.allclose(out["pi.w"], torch.tensor([2.0]))
    assert sent == 2 * 4  # two float32 uploads


def test_a_poisoned_agent_moves_the_mean_not_the_median():
    stacked = {"pi.w": torch.tensor([[1.0], [1.1], [0.9], [1e6]])}
    previous = {"pi.w": torch.tensor([1.0])}
    mean = aggregator("mean", 0, [1.0] * 4, per_round=3)
    median = aggregator("median", 0, [1.0] * 4, per_round=3)
    agents = [0, 1, 3]
    assert mean(stacked, ["pi.w"], previous, 0, agents)[0]["pi.w"].item() > 1e5
    assert abs(median(stacked, ["pi.w"], previous, 0, agents)[0]["pi.w"].item() - 1.1) < 1e-6


def test_sampling_changes_the_run_and_is_checked():
    full = fedloom.run(_cfg(None, "mean"), write=False).global_params
    half = fedloom.run(_cfg(2, "mean"), write=False).global_params
    assert full is not None and half is not None
    assert any(not torch.equal(full[k], half[k]) for k in full)
    with pytest.raises(ConfigError, match="clients_per_round"):
        parse_rl_config(_cfg(5))
    local = _cfg(2, "mean")
    local["algorithm"] = {"name": "local"}
    with pytest.raises(ConfigError, match="clients_per_round"):
        parse_rl_config(local)
