"""Poisoning attacks against robust aggregation (issue #15, docs/security.md).

The robustness setting of docs/security.md: Fashion-MNIST, softmax regression, 50
clients of 1,200 samples, all in every round, 10 malicious, 30 rounds of 1 local epoch of SGD
at lr 0.1, batch 50. Tables of the global model's test accuracy on the benign clients' data,
every attack x every aggregator, IID and Dirichlet(0.3); then Ditto (lambda 0.1): its benign
clients' personalized accuracy under each attack, next to FedAvg with each robust rule; a
backdoor's success rate per rule. Prints markdown tables, then the results as JSON.

Usage: ``FEDLOOM_DATA=../shared/data python benchmarks/robustness.py [--rounds 30]``
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import fedloom

ATTACKS: dict[str, dict[str, Any]] = {
    "none": {"kind": "none"},
    "flip 9-y": {"kind": "label_flip"},
    "A1 random labels": {"kind": "random_labels"},
    "A2 Gaussian": {"kind": "gaussian"},
    "A3 scale x50": {"kind": "scale", "scale": 50.0},
    "sign flip x4": {"kind": "sign_flip", "scale": 4.0},
}
RULES: dict[str, dict[str, Any]] = {
    "mean": {"kind": "mean"},
    "median": {"kind": "median"},
    "trimmed 0.2": {"kind": "trimmed_mean", "beta": 0.2},
    "Krum": {"kind": "krum"},
    "Multi-Krum": {"kind": "multi_krum"},
    "Bulyan": {"kind": "bulyan"},
    "clip": {"kind": "norm_clip"},
}
PARTITIONS = {"iid": {"kind": "iid"}, "dirichlet 0.3": {"kind": "dirichlet", "alpha": 0.3}}


def config(
    attack: dict[str, Any],
    rule: dict[str, Any],
    rounds: int,
    partition: dict[str, Any],
    algorithm: dict[str, Any] | None = None,
) -> dict[str, Any]:
    return {
        "seed": 0,
        "data": {"name": "fashion_mnist", "num_clients": 50, "partition": partition},
        "model": {"name": "logreg"},
        "algorithm": algorithm or {"name": "fedavg"},
        "train": {"rounds": rounds, "local_epochs": 1, "batch_size": 50, "lr": 0.1},
        "eval": {"every": rounds},
        "monitor": {"enabled": False},
        "executor": {"kind": "vectorized"},
        "attack": {**attack, "fraction": 0.2} if attack["kind"] != "none" else attack,
        "aggregator": rule,
    }


def final(result: fedloom.RunResult) -> dict[str, Any]:
    """Benign-client metrics (all clients' when there is no attack)."""
    last = result.summary["final"]
    attack = last.get("attack") or {}
    personal = last.get("personalized") or {}
    return {
        "global": (attack.get("benign_global") or last.get("global") or {}).get("accuracy"),
        "personalized": attack.get("benign_personalized_mean", personal.get("accuracy_mean")),
        "backdoor_success": attack.get("backdoor_success"),
    }


def table(title: str, rows: dict[str, dict[str, float | None]], columns: list[str]) -> str:
    lines = [f"\n{title}\n", "| attack | " + " | ".join(columns) + " |"]
    lines.append("| --- |" + " --- |" * len(columns))
    for name, row in rows.items():
        cells = [f"{row[c]:.3f}" if row.get(c) is not None else "-" for c in columns]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    out: dict[str, Any] = {}
    for pname, partition in PARTITIONS.items():
        rows: dict[str, dict[str, float | None]] = {}
        for aname, attack in ATTACKS.items():
            rows[aname] = {
                rname: final(
                    fedloom.run(
                        config(attack, rule, args.rounds, partition), write=False, progress=False
                    )
                )["global"]
                for rname, rule in RULES.items()
            }
        out[pname] = rows
        print(table(f"Global test accuracy, benign clients ({pname})", rows, list(RULES)))
    ditto = {"name": "ditto", "lam": 0.1}
    rows = {}
    for aname, attack in ATTACKS.items():
        runs = {
            "Ditto personal": final(
                fedloom.run(
                    config(attack, {"kind": "mean"}, args.rounds, PARTITIONS["iid"], ditto),
                    write=False,
                    progress=False,
                )
            )["personalized"]
        }
        for rname in ("mean", "median", "Multi-Krum"):
            runs[f"FedAvg+{rname}"] = out["iid"][aname][rname]
        rows[aname] = runs
    out["ditto"] = rows
    print(
        table(
            "Benign clients: Ditto's personalized accuracy vs FedAvg's global (IID)",
            rows,
            list(next(iter(rows.values()))),
        )
    )
    backdoor = {
        rname: final(
            fedloom.run(
                config({"kind": "backdoor"}, rule, args.rounds, PARTITIONS["iid"]),
                write=False,
                progress=False,
            )
        )
        for rname, rule in RULES.items()
    }
    out["backdoor"] = backdoor
    print("\nBackdoor (3x3 trigger -> class 0), success rate and benign accuracy per rule\n")
    print("| rule | backdoor success | benign accuracy |\n| --- | --- | --- |")
    for rname, row in backdoor.items():
        print(f"| {rname} | {row['backdoor_success']:.3f} | {row['global']:.3f} |")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
