"""Plain against missing-feature-aware aggregation (issue #20, part 5;
docs/missing_features.md).

MNIST 2NN on 100 IID clients, 10 a round, FedAvg with 1 local epoch of batch 50 at lr 0.1;
``--clients`` of the clients lack a square of ``--fraction`` of each image (``data.missing:
{kind: regions}``). The server averages with the plain weighted mean or with
``aggregator.kind: feature_aware``. Prints the global accuracy on the union of the clients'
held-out data (each client's own, with its missing region) every ``--every`` rounds, and the
accuracy on the clients that lack features and on those that do not.

Usage: ``FEDLOOM_DATA=../shared/data python benchmarks/missing_features.py [--rounds 30]``
"""

from __future__ import annotations

import argparse
from typing import Any

import fedloom
from fedloom.data.missing import MissingFeatures, feature_masks


def config(aggregator: str, args: argparse.Namespace) -> dict[str, Any]:
    return {
        "seed": 0,
        "data": {
            "name": "mnist",
            "num_clients": 100,
            "partition": {"kind": "iid"},
            "missing": {"kind": "regions", "fraction": args.fraction, "clients": args.clients},
        },
        "model": {"name": "mlp"},
        "algorithm": {"name": "fedavg"},
        "aggregator": {"kind": aggregator},
        "train": {
            "rounds": args.rounds,
            "clients_per_round": 10,
            "local_epochs": 1,
            "batch_size": 50,
            "lr": 0.1,
        },
        "eval": {"every": args.every},
        "monitor": {"enabled": False},
        "executor": {"kind": "vectorized"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--every", type=int, default=5)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--clients", type=float, default=0.5)
    args = parser.parse_args()
    missing = MissingFeatures(kind="regions", fraction=args.fraction, clients=args.clients)
    lacking = {k for k, m in enumerate(feature_masks(missing, 0, 100, (1, 28, 28))) if not m.all()}
    curves: dict[str, list[float]] = {}
    groups: dict[str, tuple[float, float]] = {}
    rounds: list[int] = []
    for aggregator in ("mean", "feature_aware"):
        run = fedloom.run(config(aggregator, args), write=False, progress=False)
        evaluated = [row for row in run.history if row.get("global")]
        rounds = [row["round"] for row in evaluated]
        curves[aggregator] = [row["global"]["accuracy"] for row in evaluated]
        per_client = {int(k): a for k, a in run.summary["final"]["client_accuracy"].items()}
        lack = [a for k, a in per_client.items() if k in lacking]
        full = [a for k, a in per_client.items() if k not in lacking]
        groups[aggregator] = (sum(lack) / len(lack), sum(full) / len(full))
    print(f"{len(lacking)} clients lack a {args.fraction:.0%} square of each image")
    print()
    heads = [f"round {r}" for r in rounds] + ["clients lacking", "clients with all"]
    print("| aggregator | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(heads))
    for name, accs in curves.items():
        cells = [f"{a:.4f}" for a in (*accs, *groups[name])]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
