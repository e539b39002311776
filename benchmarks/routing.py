"""Confidence routing between personal and global models (issue #20, part 4; docs/serving.md).

Setup: Fashion-MNIST, 20 clients, Dirichlet(0.1) labels, the 2NN (mlp), 10 clients a round,
one local epoch (batch 32, lr 0.05), 10% of each client's training data held out for
validation; personalized algorithms with a global model: Ditto (mu 0.1) and FedAvg + local
fine-tuning (fedavg_ft, 10 steps). Each run has ``serving: {keep_best: true, route: confidence,
threshold: 0.8}``; summary.json's routing uses the kept best copies. The threshold sweep
re-routes the final personal and global models on every client's test set.

    python benchmarks/routing.py [--rounds 30] [--algorithms ditto,fedavg_ft]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fedloom  # noqa: E402
from fedloom.config import parse_config  # noqa: E402
from fedloom.core.functional import FunctionalModel  # noqa: E402
from fedloom.data import load_dataset  # noqa: E402
from fedloom.models import build_model  # noqa: E402
from fedloom.serving.router import route_client  # noqa: E402

ALGORITHMS = {
    "ditto": {"name": "ditto", "mu": 0.1},
    "fedavg_ft": {"name": "fedavg_ft", "finetune_steps": 10},
}
THRESHOLDS = (0.0, 0.5, 0.8, 0.9, 0.95, 0.99, 1.0)


def config(algorithm: str, rounds: int) -> dict:
    return {
        "seed": 0,
        "data": {
            "name": "fashion_mnist",
            "num_clients": 20,
            "partition": {"kind": "dirichlet", "alpha": 0.1},
        },
        "model": {"name": "mlp"},
        "algorithm": ALGORITHMS[algorithm],
        "train": {
            "rounds": rounds,
            "clients_per_round": 10,
            "local_epochs": 1,
            "batch_size": 32,
            "lr": 0.05,
        },
        "eval": {"every": 5, "validation_fraction": 0.1},
        "checkpoint": {"every": None},
        "monitor": {"enabled": False},
        "serving": {"keep_best": True, "route": "confidence", "threshold": 0.8},
    }


def sweep(raw: dict, result: fedloom.RunResult) -> dict[str, dict[str, float]]:
    """Mean over clients of personal, global and routed accuracy per threshold (final models)."""
    cfg = parse_config(raw)
    data = load_dataset(cfg.data, cfg.seed)
    model = FunctionalModel(
        build_model(cfg.model.name, data.input_shape, data.num_outputs), data.task
    )
    out = {}
    for threshold in THRESHOLDS:
        rows = [
            route_client(
                model,
                result.client_params[c],
                result.global_params,
                data.clients[c].x_test,
                data.clients[c].y_test,
                threshold,
            ).as_dict()
            for c in result.client_params
        ]
        out[str(threshold)] = {
            k: sum(r[k] for r in rows) / len(rows)
            for k in ("personal", "global", "routed", "personal_share")
        }
    return out


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--algorithms", default="ditto,fedavg_ft")
    args = parser.parse_args(argv)
    out: dict = {}
    lines = [
        f"{'algorithm':<10} {'models':<7} {'threshold':>9} {'personal':>9} {'global':>9} "
        f"{'routed':>9} {'to personal':>12}"
    ]
    for name in args.algorithms.split(","):
        raw = config(name, args.rounds)
        start = time.perf_counter()
        result = fedloom.run(raw, write=False, progress=False)
        seconds = time.perf_counter() - start
        routing = dict(result.summary["serving"]["routing"])
        routing.pop("clients")
        out[name] = {"summary": routing, "sweep": sweep(raw, result), "seconds": seconds}
        print(f"{name}: {seconds:.0f} s", file=sys.stderr)
        lines.append(
            f"{name:<10} {'best':<7} {routing['threshold']:>9} "
            + " ".join(
                f"{routing[k]['accuracy_mean']:>9.4f}" for k in ("personal", "global", "routed")
            )
            + f" {routing['personal_share']:>12.1%}"
        )
        for threshold, row in out[name]["sweep"].items():
            lines.append(
                f"{name:<10} {'final':<7} {threshold:>9} "
                + " ".join(f"{row[k]:>9.4f}" for k in ("personal", "global", "routed"))
                + f" {row['personal_share']:>12.1%}"
            )
    print("\n".join(lines))
    line = json.dumps(out)
    print(line)
    return line


if __name__ == "__main__":
    main()
