"""DP on MNIST: accuracy against epsilon, client-level and sample-level (issue #14,
docs/privacy.md).

MNIST, 100 clients (IID and Dirichlet(0.3) label skew), the FedAvg paper's 2NN, 10 clients a
round, 1 local epoch, against non-private FedAvg with the same settings on the same clients:

- ``client_dp``: DP-FedAvg, Poisson client sampling (q = 0.1), batch 32 at lr 0.05, clip S = 1.0,
  noise multipliers 0.5, 1, 2;
- ``sample_dp``: DP-SGD in every client, Poisson minibatches of expected size 64 at lr 0.5,
  per-sample clip C = 1.0, noise multipliers 0.7, 1, 1.5 (fixed-size client sampling).

Prints one row per run (global test accuracy of the last round, epsilon at delta 1e-5 by Opacus's
RDP accountant: the worst client's for sample_dp, seconds) and, as its last line, the rows as
JSON.

Usage: ``FEDLOOM_DATA=../shared/data python benchmarks/privacy_utility.py [--rounds 30]
[--mechanisms client_dp,sample_dp]``
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import fedloom

NOISE = {"client_dp": (0.5, 1.0, 2.0), "sample_dp": (1.0, 1.5, 3.0)}
TRAIN = {"client_dp": {"batch_size": 32, "lr": 0.05}, "sample_dp": {"batch_size": 64, "lr": 0.5}}
PARTITIONS = {"iid": {"kind": "iid"}, "dirichlet_0.3": {"kind": "dirichlet", "alpha": 0.3}}


def config(
    partition: dict[str, Any], rounds: int, noise: float | None, mechanism: str = "client_dp"
) -> dict[str, Any]:
    return {
        "seed": 0,
        "data": {"name": "mnist", "num_clients": 100, "partition": partition},
        "model": {"name": "mlp"},
        "algorithm": {"name": "fedavg"},
        "train": {
            "rounds": rounds,
            "clients_per_round": 10,
            "local_epochs": 1,
            **TRAIN[mechanism],
        },
        "eval": {"every": rounds},
        "monitor": {"enabled": False},
        "executor": {"kind": "vectorized"},
        "privacy": {"kind": "none"}
        if noise is None
        else {"kind": mechanism, "noise_multiplier": noise, "clip": 1.0, "delta": 1e-5},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--mechanisms", default="client_dp,sample_dp")
    args = parser.parse_args()
    rows = []
    runs = [
        (mechanism, name, partition, noise)
        for mechanism in args.mechanisms.split(",")
        for name, partition in PARTITIONS.items()
        for noise in (None, *NOISE[mechanism])
    ]
    for mechanism, name, partition, noise in runs:
        start = time.perf_counter()
        cfg = config(partition, args.rounds, noise, mechanism)
        result = fedloom.run(cfg, write=False, progress=False)
        seconds = time.perf_counter() - start
        privacy = result.summary.get("privacy", {})
        row = {
            "mechanism": mechanism,
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
            f"{mechanism:9s} {name:14s} {label:7s} accuracy {row['accuracy']:.4f}  "
            f"epsilon {eps:>7s}  {seconds:6.1f} s",
            flush=True,
        )
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
