"""Client-level DP-FedAvg on MNIST: accuracy against epsilon (issue #14, docs/privacy.md).

MNIST, 100 clients (IID and Dirichlet(0.3) label skew), the FedAvg paper's 2NN, 10 clients a
round by Poisson sampling (q = 0.1), 1 local epoch of batch 32 at lr 0.05, clip S = 1.0: three
noise multipliers against non-private FedAvg on the same clients. Prints one row per run (global
test accuracy of the last round, epsilon at delta 1e-5 by Opacus's RDP accountant, seconds) and,
as its last line, the rows as JSON.

Usage: ``FEDLOOM_DATA=../shared/data python benchmarks/privacy_utility.py [--rounds 30]``
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import fedloom

NOISE = (0.5, 1.0, 2.0)
PARTITIONS = {"iid": {"kind": "iid"}, "dirichlet_0.3": {"kind": "dirichlet", "alpha": 0.3}}


def config(partition: dict[str, Any], rounds: int, noise: float | None) -> dict[str, Any]:
    return {
        "seed": 0,
        "data": {"name": "mnist", "num_clients": 100, "partition": partition},
        "model": {"name": "mlp"},
        "algorithm": {"name": "fedavg"},
        "train": {
            "rounds": rounds,
            "clients_per_round": 10,
            "local_epochs": 1,
            "batch_size": 32,
            "lr": 0.05,
        },
        "eval": {"every": rounds},
        "monitor": {"enabled": False},
        "executor": {"kind": "vectorized"},
        "privacy": {"kind": "none"}
        if noise is None
        else {"kind": "client_dp", "noise_multiplier": noise, "clip": 1.0, "delta": 1e-5},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    rows = []
    for name, partition in PARTITIONS.items():
        for noise in (None, *NOISE):
            start = time.perf_counter()
            result = fedloom.run(config(partition, args.rounds, noise), write=False, progress=False)
            seconds = time.perf_counter() - start
            privacy = result.summary.get("privacy", {})
            row = {
                "partition": name,
                "noise_multiplier": noise,
                "accuracy": result.summary["final"]["global"]["accuracy"],
                "epsilon": privacy.get("epsilon"),
                "seconds": round(seconds, 1),
            }
            rows.append(row)
            eps = "-" if noise is None else f"{row['epsilon']:.2f}"
            label = "none" if noise is None else f"z={noise}"
            print(
                f"{name:14s} {label:7s} accuracy {row['accuracy']:.4f}  epsilon {eps:>7s}  "
                f"{seconds:6.1f} s",
                flush=True,
            )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
