"""Distributed DP on MNIST: accuracy against epsilon, the distributed discrete Gaussian next to
client-level DP-FedAvg at the same epsilon (issue #28, docs/privacy.md).

MNIST, 20 clients (IID), logistic regression (7,850 parameters, rotated in 8,192), FedAvg, every
client every round (q = 1), 1 local epoch, batch 32, lr 0.05, clip 1.0, delta 1e-5:

- ``distributed_dp``: SecAgg, b = 16 bits, beta = exp(-1/2), gamma derived (k = 4), the noise
  calibrated to each target epsilon by the paper's accountant;
- ``client_dp``: DP-FedAvg with the noise calibrated by Opacus's RDP accountant (fixed
  sampling: every client each round).

Prints one row per run (global test accuracy of the last round, epsilon spent, the noise
multiplier, bytes a client uploads, seconds) and, as its last line, the rows as JSON.

Usage: ``FEDLOOM_DATA=<data dir> python benchmarks/distributed_dp.py [--rounds 10]
[--epsilons 10,50,200]``
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import fedloom


def config(rounds: int, mechanism: str | None, target: float) -> dict[str, Any]:
    privacy: dict[str, Any] = {"kind": "none"}
    secure: dict[str, Any] = {"kind": "none"}
    if mechanism is not None:
        privacy = {"kind": mechanism, "target_epsilon": target, "clip": 1.0, "delta": 1e-5}
        privacy["sampling"] = "fixed"
    if mechanism == "distributed_dp":
        privacy |= {"bits": 16}
        secure = {"kind": "secagg"}
    return {
        "seed": 0,
        "data": {"name": "mnist", "num_clients": 20, "partition": {"kind": "iid"}},
        "model": {"name": "logreg"},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": rounds, "clients_per_round": 20, "local_epochs": 1,
                  "batch_size": 32, "lr": 0.05},
        "eval": {"every": rounds},
        "monitor": {"enabled": False},
        "executor": {"kind": "sequential"},
        "privacy": privacy,
        "secure_aggregation": secure,
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--epsilons", default="10,50,200")
    args = parser.parse_args()
    runs: list[tuple[str | None, float]] = [(None, 0.0)]
    for eps in (float(e) for e in args.epsilons.split(",")):
        runs += [("distributed_dp", eps), ("client_dp", eps)]
    rows = []
    for mechanism, target in runs:
        start = time.perf_counter()
        result = fedloom.run(config(args.rounds, mechanism, target), write=False, progress=False)
        privacy = result.summary.get("privacy", {})
        row = {
            "mechanism": mechanism or "none",
            "target_epsilon": target or None,
            "epsilon": privacy.get("epsilon"),
            "noise_multiplier": privacy.get("noise_multiplier"),
            "accuracy": result.summary["final"]["global"]["accuracy"],
            "payload_bytes_per_client": privacy.get("payload_bytes_per_client", 4 * 7850),
            "seconds": round(time.perf_counter() - start, 1),
        }
        rows.append(row)
        print(row, flush=True)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
