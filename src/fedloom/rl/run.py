"""An RL run from its config (docs/rl.md): the learner, a greedy evaluation every
``eval.every`` rounds, checkpoints, and the standard run directory (``config.yaml``,
``metrics.jsonl``, ``summary.json``, ``checkpoints/``, ``report.html``), all kept by the run
shell every run family goes through (engine/shell.py, docs/rl.md).

Each metrics row: ``round``, ``train_return`` (mean return of the round's training episodes),
``train_loss``, ``returns`` (``{"train": {env: mean greedy return}, "unseen": {...}}``), their
means, cumulative ``communication`` (PAvg/QAvg: parameters up and down; vertical: B's
activations up, A's gradients down), ``env_steps`` and ``wall_seconds``. A resumed run
continues from the newest checkpoint and equals the uninterrupted one.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fedloom.engine.shell import (
    ConfigRunner,
    RunInputs,
    RunResult,
    RunShell,
    Timing,
    base_summary,
    resume_state,
    shell_payload,
)
from fedloom.engine.threads import torch_threads
from fedloom.rl.config import RLRunConfig, VerticalDQNConfig, parse_rl_config
from fedloom.rl.horizontal import PolicyAgents, QAgents
from fedloom.rl.ppo_agents import PPOAgents
from fedloom.rl.vertical_agents import VerticalAgents


def build_learner(cfg: RLRunConfig) -> PolicyAgents | PPOAgents | QAgents | VerticalAgents:
    if isinstance(cfg.algorithm, VerticalDQNConfig):
        return VerticalAgents(cfg)
    learners = {"reinforce": PolicyAgents, "ppo": PPOAgents, "dqn": QAgents}
    return learners[cfg.learner](cfg)


def _mean(values: dict[str, float]) -> float | None:
    return sum(values.values()) / len(values) if values else None


def _row(round: int, stats: dict[str, Any], returns: dict, learner: Any, wall: float) -> dict:
    both = {**returns["train"], **returns["unseen"]}
    aggregator = getattr(learner, "aggregator", None)  # vertical agents have none
    spent = aggregator.privacy_spent() if aggregator is not None else None
    return {
        "round": round,
        **stats,
        "returns": returns,
        "return_train_mean": _mean(returns["train"]),
        "return_unseen_mean": _mean(returns["unseen"]),
        "return_mean": _mean(both),
        "communication": {"bytes_up": learner.bytes_up, "bytes_down": learner.bytes_down},
        "env_steps": learner.env_steps,
        "wall_seconds": wall,
        **({"privacy": spent} if spent is not None else {}),
    }


class RLFamily:
    """Federated RL in ``fedloom.run``'s registry (api.py): an RL config, no data or model of
    the caller's."""

    def check_inputs(self, inputs: RunInputs) -> None:
        inputs.refuse(("data", "model", "executor", "callbacks"), "an RL run", "docs/rl.md")

    def parse(self, config: Any, inputs: RunInputs) -> RLRunConfig:
        return parse_rl_config(config)

    def parse_saved(self, path: Path) -> RLRunConfig:
        return parse_rl_config(path)

    def timing(self, cfg: RLRunConfig) -> Timing:
        return Timing(cfg.train.rounds, cfg.eval.every, cfg.checkpoint)

    def runner(self, cfg: RLRunConfig, inputs: RunInputs) -> RLRunner:
        return RLRunner(cfg)


class RLRunner(ConfigRunner):
    """The rounds of one RL run. It uses one torch thread: its tensors are small, and one
    thread is faster for small steps (engine/threads.py, SMALL_STEP_MACS)."""

    cfg: RLRunConfig

    def run(self, shell: RunShell) -> RunResult:
        with torch_threads(1):
            return self._run(shell)

    def _run(self, shell: RunShell) -> RunResult:
        cfg = self.cfg
        learner = build_learner(cfg)
        saved = resume_state(shell)
        if saved is not None:
            learner.load_state_dict(saved)
        shell.begin()
        eval_seconds = 0.0
        for r in range(shell.start_round, cfg.train.rounds):
            stats = learner.train_round(r)
            done, row = r + 1, None
            if shell.evaluates(done):
                t = time.perf_counter()
                returns = learner.evaluate()
                eval_seconds += time.perf_counter() - t
                row = _row(done, stats, returns, learner, shell.elapsed)
            shell.end_round(done, row, lambda d=done: shell_payload(shell, d, learner.state_dict()))
        summary = _summary(cfg, learner, shell.history[-1], shell.elapsed, eval_seconds)
        glob, clients = learner.deployed()
        return RunResult(
            summary, shell.history, glob, clients, shell.run_dir, extras={"learner": learner}
        )


def _summary(cfg: RLRunConfig, learner: Any, last: dict, wall: float, eval_s: float) -> dict:
    returns = last["returns"]
    train = returns["train"]
    algo = cfg.algorithm
    has_global = cfg.averages
    train_s = max(wall - eval_s, 1e-9)
    mechanisms = learner.aggregator.summary() if has_global else {}
    extra: dict[str, Any] = {
        "learner": cfg.learner,
        "environment": cfg.data.name,
        "local_steps": cfg.train.local_steps,
        "iterations": cfg.train.rounds * cfg.train.local_steps,
        "env_steps": learner.env_steps,
        "env_steps_per_second": learner.env_steps / train_s,
        "seconds_evaluation": eval_s,
        "aggregator": mechanisms.pop("aggregator", None),
    }
    if isinstance(algo, VerticalDQNConfig):
        extra["vertical"] = {
            "mode": algo.mode,
            "noise_std": algo.noise_std,
            "party_a": algo.party_a,
            "party_b": algo.party_b,
            "bytes_by_party": {
                "party_a": {"sent": learner.bytes_down, "received": learner.bytes_up},
                "party_b": {"sent": learner.bytes_up, "received": learner.bytes_down},
            },
        }
    summary = base_summary(
        algorithm=algo.name,
        dataset=cfg.data.name,
        num_clients=2 if isinstance(algo, VerticalDQNConfig) else cfg.data.num_clients,
        rounds=cfg.train.rounds,
        seed=cfg.seed,
        executor="batched",
        final={
            "global": (
                {
                    "return_train_mean": last["return_train_mean"],
                    "return_unseen_mean": last["return_unseen_mean"],
                }
                if has_global
                else None
            ),
            "personalized": {
                "return_mean": _mean(train),
                "return_min": min(train.values()) if train else None,
            },
            "returns": returns,
            "return_train_mean": last["return_train_mean"],
            "return_unseen_mean": last["return_unseen_mean"],
            "return_mean": last["return_mean"],
        },
        communication=last["communication"],
        wall_seconds=wall,
        seconds_per_round=wall / cfg.train.rounds,
    )
    return {**summary, **mechanisms, "rl": extra}
