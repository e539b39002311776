"""IFCA on rotated MNIST (Ghosh et al. 2020, Section 5.2): clients in 4 planted groups, client c's
images rotated by (0, 90, 180, 270)[c % 4] degrees (``partition: rotation``). Prints, per seed,
IFCA's cluster recovery (the share of clients whose identity matches its group under the best
relabelling) and the personalized accuracy of IFCA, FedAvg and local training.

    python benchmarks/ifca.py --seeds 0 1 2 --rounds 20
    python benchmarks/ifca.py --dataset digits --model mlp --rounds 20   # no download
    python benchmarks/ifca.py --clients 40 --seeds 0 1 2 3 4 5 6 7 --reseed-empty --restarts 3

``--restarts``, ``--restart-rounds`` and ``--reseed-empty`` turn on IFCA's remedies for empty
clusters (algorithms/ifca.py); ``--only-ifca`` skips FedAvg and local training.

The last line of stdout is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import fedloom
from fedloom.algorithms.clusters import cluster_agreement


def config(args: argparse.Namespace, algorithm: dict[str, Any], seed: int) -> dict[str, Any]:
    return {
        "seed": seed,
        "data": {
            "name": args.dataset,
            "num_clients": args.clients,
            "partition": {"kind": "rotation", "angles": [0, 90, 180, 270]},
        },
        "model": {"name": args.model},
        "algorithm": algorithm,
        "train": {
            "rounds": args.rounds,
            "clients_per_round": args.per_round,
            "local_steps": args.local_steps,
            "batch_size": 32,
            "lr": args.lr,
        },
        "eval": {"every": args.rounds},
        "monitor": {"enabled": False},
        "checkpoint": {"every": None},
        "executor": {"kind": args.executor},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset", default="mnist")
    parser.add_argument("--model", default="logreg")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--local-steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--executor", default="auto")
    parser.add_argument("--restarts", type=int, default=1)
    parser.add_argument("--restart-rounds", type=int, default=3)
    parser.add_argument("--reseed-empty", action="store_true")
    parser.add_argument("--only-ifca", action="store_true")
    args = parser.parse_args()
    planted = [c % 4 for c in range(args.clients)]
    ifca = {
        "name": "ifca",
        "k": args.k,
        "restarts": args.restarts,
        "restart_rounds": args.restart_rounds,
        "reseed_empty": args.reseed_empty,
    }
    contenders: dict[str, dict[str, Any]] = {"ifca": ifca}
    if not args.only_ifca:
        contenders |= {"fedavg": {"name": "fedavg"}, "local": {"name": "local"}}
    table: dict[str, Any] = {"args": vars(args), "runs": []}
    for seed in args.seeds:
        row: dict[str, Any] = {"seed": seed}
        for name, algorithm in contenders.items():
            tick = time.perf_counter()
            result = fedloom.run(config(args, algorithm, seed), write=False, progress=False)
            personalized = result.summary["final"]["personalized"]
            row[name] = {
                "accuracy_mean": personalized["accuracy_mean"],
                "accuracy_p10": personalized.get("accuracy_p10"),
                "seconds": round(time.perf_counter() - tick, 1),
            }
            if name == "ifca":
                found = result.summary["extras"]["cluster_identity"][: args.clients]
                row[name]["recovery"] = cluster_agreement(found, planted)
                row[name]["cluster_sizes"] = result.summary["extras"]["cluster_sizes"]
        table["runs"].append(row)
        print(
            f"seed {seed}: IFCA recovery {row['ifca']['recovery']:.2f} "
            f"sizes {row['ifca']['cluster_sizes']} | personalized accuracy: "
            + ", ".join(f"{n} {row[n]['accuracy_mean']:.4f}" for n in contenders)
            + " | seconds: "
            + ", ".join(f"{n} {row[n]['seconds']}" for n in contenders),
            flush=True,
        )
    print(json.dumps(table))


if __name__ == "__main__":
    main()
