"""RL runs from YAML through ``fedloom.run``: the run directory and summary contract, resume
equal to an uninterrupted run, aggregation rules, config errors, Gymnasium's vector path."""

from __future__ import annotations

import json

import pytest
import torch

import fedloom
from fedloom.errors import ConfigError
from fedloom.rl.config import parse_rl_config
from fedloom.rl.policy_gradient import policy_logits, reinforce_grads, rollout
from tests.conftest import metrics_without_time
from tests.resume import Crash, crash_after
from tests.rl.test_sampling import aggregator


def _cfg(algorithm: dict, **train) -> dict:
    return {
        "seed": 3,
        "data": {
            "name": "cartpole",
            "num_clients": 3,
            "envs_per_client": 4,
            "cartpole": {"lengths": [0.3, 0.6, 1.0], "unseen_lengths": [2.0]},
        },
        "model": {"hidden": [16]},
        "algorithm": algorithm,
        "train": {"rounds": 4, "local_steps": 2, **train},
        "eval": {"every": 1, "episodes": 3},
        "checkpoint": {"every": 2, "keep": 2},
    }


def test_pavg_run_directory_and_summary(tmp_path):
    result = fedloom.run(_cfg({"name": "pavg"}), out=tmp_path / "run")
    run = tmp_path / "run"
    assert {p.name for p in run.iterdir()} >= {
        "config.yaml",
        "metrics.jsonl",
        "summary.json",
        "report.html",
        "checkpoints",
    }
    summary = json.loads((run / "summary.json").read_text())
    final = summary["final"]
    assert set(final["returns"]["train"]) == {"length=0.3", "length=0.6", "length=1"}
    assert set(final["returns"]["unseen"]) == {"length=2"}
    assert all(1 <= v <= 500 for v in final["returns"]["train"].values())
    # every agent uploads and downloads the policy once per round: 4 rounds x 3 agents
    n_params = sum(v.numel() for v in result.global_params.values())
    assert summary["communication"] == {
        "bytes_up": 4 * 3 * 4 * n_params,
        "bytes_down": 4 * 3 * 4 * n_params,
    }
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2, 3, 4]
    # after the broadcast every agent deploys the global policy
    for params in result.client_params.values():
        assert all(torch.equal(params[k], v) for k, v in result.global_params.items())
    html = (run / "report.html").read_text()
    assert "Greedy return per environment" in html


@pytest.mark.parametrize(
    "algorithm",
    [
        {"name": "pavg_embedding", "mu": 0.1},
        # double DQN with the federated target network (issue #28)
        {"name": "qavg", "learning_starts": 8, "batch_size": 8, "target_every": 3, "double": True},
        {"name": "pavg_ppo_embedding", "mu": 0.1, "num_steps": 8},
        {"name": "vertical_dqn", "learning_starts": 8, "batch_size": 8, "noise_std": 0.1},
    ],
    ids=lambda a: a["name"],
)
def test_resume_equals_uninterrupted(tmp_path, algorithm):
    cfg = _cfg(algorithm)
    full = fedloom.run(cfg, out=tmp_path / "full")
    with pytest.raises(Crash), crash_after(3):  # checkpoint: round 2
        fedloom.run(cfg, out=tmp_path / "killed")
    resumed = fedloom.run(resume=tmp_path / "killed")
    assert metrics_without_time(resumed.history) == metrics_without_time(full.history)
    rows = [json.loads(x) for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert metrics_without_time(rows) == metrics_without_time(full.history)
    for c, params in full.client_params.items():
        assert all(torch.equal(v, resumed.client_params[c][k]) for k, v in params.items())


def test_local_agents_do_not_communicate_and_differ():
    result = fedloom.run(_cfg({"name": "local"}), write=False)
    assert result.summary["communication"] == {"bytes_up": 0, "bytes_down": 0}
    assert result.global_params is None
    a, b = result.client_params[0], result.client_params[1]
    assert not torch.equal(a["pi.0.weight"], b["pi.0.weight"])


def test_aggregators_are_fedloom_rules():
    """Mean: the weighted mean; median: fedloom.robust's coordinate median of the updates,
    which ignores one wild agent."""
    stacked = {"w": torch.tensor([[1.0, 2.0], [3.0, 4.0], [100.0, -100.0]])}
    prev = {"w": torch.zeros(2)}
    mean, _ = aggregator("mean", 0, [1.0, 1.0, 2.0])(stacked, ["w"], prev, 0)
    assert torch.allclose(mean["w"], torch.tensor([51.0, -48.5]))
    med, _ = aggregator("median", 0, [1.0] * 3)(stacked, ["w"], prev, 0)
    assert torch.allclose(med["w"], torch.tensor([3.0, 2.0]))


def test_fedprox_term_pulls_towards_the_broadcast():
    cfg = parse_rl_config(_cfg({"name": "pavg"}))
    from fedloom.rl.horizontal import PolicyAgents

    agents = PolicyAgents(cfg)
    ep = rollout(
        agents.env, lambda o: policy_logits(agents.params, o), 3, torch.Generator().manual_seed(0)
    )
    anchor = {k: torch.zeros_like(v) for k, v in agents.params.items()}
    plain, _ = reinforce_grads(agents.params, ep, 0.99)
    prox, _ = reinforce_grads(agents.params, ep, 0.99, anchor=anchor, mu=0.5)
    for k, v in agents.params.items():
        assert torch.allclose(prox[k] - plain[k], 0.5 * v, atol=1e-6)


def test_robust_aggregator_runs_in_a_pavg_run():
    cfg = _cfg({"name": "pavg"})
    cfg["aggregator"] = {"kind": "trimmed_mean", "beta": 0.34}
    result = fedloom.run(cfg, write=False)
    assert result.summary["rl"]["aggregator"]["kind"] == "trimmed_mean"


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        (
            {"data": {"name": "cartpole", "envs_per_clients": 2}},
            "Did you mean 'data.envs_per_client'",
        ),
        ({"algorithm": {"name": "qavgg"}}, "Did you mean 'qavg'"),
        ({"algorithm": {"name": "local"}, "aggregator": {"kind": "median"}}, "does not aggregate"),
        ({"data": {"name": "acrobot"}, "algorithm": {"name": "qavg"}}, "acrobot"),
        ({"algorithm": {"name": "vertical_dqn", "party_a": [0, 2]}}, "must not share"),
        ({"aggregator": {"kind": "krum", "f": 1}}, r"krum with f=1 needs more than 4 clients"),
    ],
)
def test_config_errors_name_the_key(patch, message):
    cfg = {**_cfg({"name": "pavg"}), **patch}
    with pytest.raises(ConfigError, match=message):
        fedloom.run(cfg, write=False)


def test_acrobot_through_gymnasium_vector_api():
    cfg = {
        "data": {
            "name": "acrobot",
            "num_clients": 2,
            "envs_per_client": 2,
            "acrobot": {"link_masses": [1.0, 1.5], "unseen_link_masses": [2.0]},
        },
        "algorithm": {"name": "pavg"},
        "train": {"rounds": 1, "local_steps": 1},
        "eval": {"episodes": 1},
    }
    summary = fedloom.run(cfg, write=False).summary
    returns = summary["final"]["returns"]
    assert set(returns["train"]) == {"link_mass_2=1", "link_mass_2=1.5"}
    assert all(-500 <= v < 0 for v in returns["train"].values())
