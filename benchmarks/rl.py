"""Federated RL measurements (Jin et al., AISTATS 2022; Zhuo et al. 2019; docs/rl.md; issue #18):

- HFRL: PAvg, personalized PAvg and local REINFORCE agents on CartPole (4 agents, half-lengths
  0.25/0.5/1.0/1.5, 16 environments each; PAvg every 5 iterations), greedy return per training
  and unseen length after 60 and 100 iterations, per seed.
- QAvg vs local DQN agents in the same setting (2,000 iterations, averaging every 10), with
  DQN and Double DQN (van Hasselt et al. 2016) targets.
- PPO: PAvg with PPO agents (CleanRL's ppo.py defaults, 4 environments per agent) and local
  PPO agents vs PAvg with REINFORCE, greedy return on the training and unseen lengths, per
  seed, with the environment steps each used.
- VFRL: vertical federated DQN (sigma 0 and 0.1) vs the Q-party alone vs centralized DQN (32
  environments, 3,000 iterations), greedy return every 500 iterations, per seed.
- Speed: CartPole environment steps per second, the torch-batched CartPole (N environments in
  one call) vs Gymnasium's CartPole-v1 one environment at a time.

    .venv/bin/python benchmarks/rl.py [--seeds 0 1 2] [--skip speed hfrl qavg ppo vfrl]
        [--qavg-variants qavg local_dqn qavg_double local_dqn_double qavg_local_target
         qavg_double_local_target] [--qavg-every 10] [--qavg-lengths 0.5 0.5 0.5 0.5]
        [--ppo-algorithms pavg pavg_ppo local_ppo] [--ppo-iterations 200] [--out FILE]

Prints Markdown tables (and, with ``--out``, writes the results as JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import gymnasium as gym
import torch

import fedloom
from fedloom.rl.cartpole import CartPoleBatch, CartPoleParams


def hfrl(seed: int, algorithm: str) -> dict:
    cfg = {
        "seed": seed,
        "data": {"name": "cartpole", "num_clients": 4, "envs_per_client": 16},
        "algorithm": {"name": algorithm},
        "train": {"rounds": 20, "local_steps": 5, "lr": 0.01},
        "eval": {"every": 4, "episodes": 20},
    }
    t = time.perf_counter()
    result = fedloom.run(cfg, write=False)
    rows = {row["round"] * 5: row for row in result.history}
    return {
        "seconds": time.perf_counter() - t,
        "at": {it: rows[it]["returns"] for it in (60, 100)},
        "mean": {it: rows[it]["return_mean"] for it in (60, 100)},
        "train_mean": {it: rows[it]["return_train_mean"] for it in (60, 100)},
        "unseen_mean": {it: rows[it]["return_unseen_mean"] for it in (60, 100)},
        "bytes_up": result.summary["communication"]["bytes_up"],
    }


def _final(cfg: dict) -> dict:
    """One run's final greedy returns (training and unseen means), environment steps per agent
    and seconds; printed as one line when it ends (long sections)."""
    t = time.perf_counter()
    summary = fedloom.run(cfg, write=False).summary
    final = summary["final"]
    out = {
        "seconds": time.perf_counter() - t,
        "train_mean": final["return_train_mean"],
        "unseen_mean": final["return_unseen_mean"],
        "returns": final["returns"],
        "env_steps_per_agent": summary["rl"]["env_steps"] // cfg["data"]["num_clients"],
    }
    name = " ".join(f"{k}={v}" for k, v in cfg["algorithm"].items())
    print(f"# {name} seed {cfg['seed']}: {json.dumps(out)}", flush=True)
    return out


QAVG_VARIANTS = {
    "qavg": {"name": "qavg"},
    "local_dqn": {"name": "local_dqn"},
    "qavg_double": {"name": "qavg", "double": True},
    "local_dqn_double": {"name": "local_dqn", "double": True},
    "qavg_local_target": {"name": "qavg", "global_target": False},
    "qavg_double_local_target": {"name": "qavg", "double": True, "global_target": False},
}


def qavg(seed: int, variant: str, local_steps: int = 10, lengths: list | None = None) -> dict:
    """QAvg vs local DQN agents in the HFRL setting (MLP 4-64-64-2, 2,000 iterations,
    averaging every ``local_steps``; ``lengths``: the agents' half-lengths, default
    0.25/0.5/1.0/1.5)."""
    data = {"name": "cartpole", "num_clients": 4, "envs_per_client": 16}
    if lengths:
        data["cartpole"] = {"lengths": lengths}
    return _final(
        {
            "seed": seed,
            "data": data,
            "model": {"hidden": [64, 64]},
            "algorithm": QAVG_VARIANTS[variant],
            "train": {"rounds": 2000 // local_steps, "local_steps": local_steps},
            "eval": {"every": 2000 // local_steps, "episodes": 20},
        }
    )


def ppo(seed: int, algorithm: str, iterations: int) -> dict:
    """PAvg with REINFORCE (``pavg``: the HFRL setting, 16 environments per agent, 4-32-2 tanh,
    Adam 1e-2) or with PPO (``pavg_ppo``, ``local_ppo``: CleanRL's ppo.py defaults, 4
    environments per agent, 64-64 tanh actor and critic), averaging every 5 iterations."""
    reinforce = algorithm == "pavg"
    return _final(
        {
            "seed": seed,
            "data": {
                "name": "cartpole",
                "num_clients": 4,
                "envs_per_client": 16 if reinforce else 4,
            },
            "model": {"hidden": [32] if reinforce else [64, 64]},
            "algorithm": {"name": algorithm},
            "train": {"rounds": iterations // 5, "local_steps": 5},
            "eval": {"every": iterations // 5, "episodes": 20},
        }
    )


def vfrl(seed: int, mode: str, noise: float = 0.0) -> dict:
    cfg = {
        "seed": seed,
        "data": {
            "name": "cartpole",
            "envs_per_client": 32,
            "cartpole": {"lengths": [0.5], "unseen_lengths": []},
        },
        "model": {"hidden": [64]},
        "algorithm": {"name": "vertical_dqn", "mode": mode, "noise_std": noise},
        "train": {"rounds": 6, "local_steps": 500, "lr": 5e-4},
        "eval": {"every": 1, "episodes": 50},
    }
    t = time.perf_counter()
    result = fedloom.run(cfg, write=False)
    return {
        "seconds": time.perf_counter() - t,
        "returns": {row["round"] * 500: row["return_train_mean"] for row in result.history},
        "bytes_up": result.summary["communication"]["bytes_up"],
        "bytes_down": result.summary["communication"]["bytes_down"],
    }


def speed(steps: int = 2000) -> dict:
    out: dict[str, float] = {}
    env = gym.make("CartPole-v1")
    env.reset(seed=0)
    env.action_space.seed(0)
    t = time.perf_counter()
    for _ in range(steps * 5):
        _, _, term, trunc, _ = env.step(env.action_space.sample())
        if term or trunc:
            env.reset()
    out["gymnasium_one_env"] = steps * 5 / (time.perf_counter() - t)
    gen = torch.Generator().manual_seed(0)
    for n in (64, 1024, 16384):
        batch = CartPoleBatch(CartPoleParams.make(torch.linspace(0.25, 1.5, n)))
        batch.reset(gen)
        t = time.perf_counter()
        for _ in range(steps):
            batch.step(torch.randint(0, 2, (n,), generator=gen), gen)
        out[f"batched_{n}"] = n * steps / (time.perf_counter() - t)
    return out


def _table(by_method: dict) -> None:
    print("| method | seed | training lengths | unseen lengths | env steps per agent | s |")
    print("|---|---|---:|---:|---:|---:|")
    for a, by_seed in by_method.items():
        for s, r in by_seed.items():
            row = f"| {a} | {s} | {r['train_mean']:.0f} | {r['unseen_mean']:.0f}"
            print(f"{row} | {r['env_steps_per_agent']:,} | {r['seconds']:.0f} |")
        means = [r["train_mean"] for r in by_seed.values()]
        print(f"| {a} | mean | {statistics.mean(means):.0f} | | | |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--skip", nargs="*", default=[])
    p.add_argument("--qavg-variants", nargs="+", default=list(QAVG_VARIANTS))
    p.add_argument("--qavg-every", type=int, default=10, help="QAvg's E (local iterations)")
    p.add_argument(
        "--qavg-lengths", type=float, nargs="+", default=None, help="e.g. 0.5 0.5 0.5 0.5"
    )
    p.add_argument("--ppo-algorithms", nargs="+", default=["pavg", "pavg_ppo", "local_ppo"])
    p.add_argument("--ppo-iterations", type=int, default=200, help="PPO runs' iterations")
    p.add_argument("--out", default=None, help="also write the results as JSON here")
    args = p.parse_args()
    torch.set_num_threads(1)
    res: dict = {"seeds": args.seeds}
    if "speed" not in args.skip:
        res["speed"] = speed()
        print("\n| environment steps per second | |\n|---|---:|")
        for k, v in res["speed"].items():
            print(f"| {k} | {v:,.0f} |")
    if "hfrl" not in args.skip:
        res["hfrl"] = {
            a: {s: hfrl(s, a) for s in args.seeds} for a in ("pavg", "local", "pavg_embedding")
        }
        for it in (60, 100):
            print(f"\n**HFRL after {it} iterations** (greedy return, 20 episodes per length)\n")
            first = res["hfrl"]["pavg"][args.seeds[0]]["at"][it]
            envs = [*first["train"], *(f"{e} (unseen)" for e in first["unseen"])]
            print("| method | seed | " + " | ".join(envs) + " | mean | s |")
            print("|---|---|" + "---:|" * (len(envs) + 2))
            for a, by_seed in res["hfrl"].items():
                for s, r in by_seed.items():
                    vals = [*r["at"][it]["train"].values(), *r["at"][it]["unseen"].values()]
                    cells = " | ".join(f"{v:.0f}" for v in vals)
                    print(f"| {a} | {s} | {cells} | {r['mean'][it]:.0f} | {r['seconds']:.0f} |")
    if "qavg" not in args.skip:
        res["qavg"] = {
            a: {s: qavg(s, a, args.qavg_every, args.qavg_lengths) for s in args.seeds}
            for a in args.qavg_variants
        }
        print("\n**QAvg vs local DQN** (2,000 iterations; greedy return, mean over lengths)\n")
        _table(res["qavg"])
    if "ppo" not in args.skip:
        res["ppo"] = {
            a: {s: ppo(s, a, 100 if a == "pavg" else args.ppo_iterations) for s in args.seeds}
            for a in args.ppo_algorithms
        }
        print("\n**PPO vs REINFORCE** (greedy return, mean over lengths)\n")
        _table(res["ppo"])
    if "vfrl" not in args.skip:
        runs = {
            "vertical": ("vertical", 0.0),
            "vertical_sigma0.1": ("vertical", 0.1),
            "party_a": ("party_a", 0.0),
            "centralized": ("centralized", 0.0),
        }
        res["vfrl"] = {k: {s: vfrl(s, m, sig) for s in args.seeds} for k, (m, sig) in runs.items()}
        print("\n**VFRL** (greedy return over 50 episodes, by iterations)\n")
        print("| method | seed | 500 | 1000 | 1500 | 2000 | 2500 | 3000 | s |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
        for k, by_seed in res["vfrl"].items():
            for s, r in by_seed.items():
                cells = " | ".join(f"{v:.0f}" for v in r["returns"].values())
                print(f"| {k} | {s} | {cells} | {r['seconds']:.0f} |")
            for it in (1500, 3000):
                med = statistics.median(r["returns"][it] for r in by_seed.values())
                print(f"| {k} | median | {it} it.: {med:.0f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
