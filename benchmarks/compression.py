"""Accuracy against bytes uploaded for each compression scheme (issue #20, part 2;
docs/compression.md).

The FedAvg paper's MNIST 2NN (two hidden layers of 200, 199,210 parameters) on 100 clients
(IID, 600 samples each), 10 clients a round, 1 local epoch of batch 50 at lr 0.1; every scheme
of ``compression.kind`` (top-k and random-k with error feedback, QSGD without, fp16, int8) next
to no compression. Every ``--every`` rounds the global model's accuracy on the union of the
clients' held-out data is recorded with the bytes uploaded so far (as encoded), which gives the
accuracy-vs-bytes curve; prints a markdown table (final accuracy, MB up and down, compression
factor of the uploads, the first evaluated round and the MB up by which the global model reached
``--target`` accuracy) and the curves as JSON.

Usage: ``FEDLOOM_DATA=../shared/data python benchmarks/compression.py [--rounds 60]``
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import fedloom

SCHEMES: dict[str, dict[str, Any]] = {
    "none": {"kind": "none"},
    "topk 1% +EF": {"kind": "topk", "ratio": 0.01},
    "topk 10% +EF": {"kind": "topk", "ratio": 0.1},
    "randk 10% +EF": {"kind": "randk", "ratio": 0.1},
    "qsgd s=16": {"kind": "qsgd", "levels": 16},
    "fp16": {"kind": "fp16"},
    "int8": {"kind": "int8"},
    "int8, int8 down": {"kind": "int8", "download": "int8"},
}


def config(scheme: dict[str, Any], rounds: int, every: int) -> dict[str, Any]:
    return {
        "seed": 0,
        "data": {"name": "mnist", "num_clients": 100, "partition": {"kind": "iid"}},
        "model": {"name": "mlp"},
        "algorithm": {"name": "fedavg"},
        "train": {
            "rounds": rounds,
            "clients_per_round": 10,
            "local_epochs": 1,
            "batch_size": 50,
            "lr": 0.1,
        },
        "eval": {"every": every},
        "monitor": {"enabled": False},
        "executor": {"kind": "vectorized"},
        "compression": scheme,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--target", type=float, default=0.85)
    parser.add_argument("--schemes", nargs="*", default=list(SCHEMES), choices=list(SCHEMES))
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    for name in args.schemes:
        tick = time.perf_counter()
        run = fedloom.run(
            config(SCHEMES[name], args.rounds, args.every), write=False, progress=False
        )
        curve = [
            {
                "round": row["round"],
                "mb_up": row["communication"]["bytes_up"] / 1e6,
                "accuracy": row["global"]["accuracy"],
            }
            for row in run.history
            if row.get("global")
        ]
        comm = run.summary["communication"]
        comp = run.summary.get("compression", {})
        results[name] = {
            "accuracy": run.summary["final"]["global"]["accuracy"],
            "mb_up": comm["bytes_up"] / 1e6,
            "mb_down": comm["bytes_down"] / 1e6,
            "factor": comp.get("compression_factor") or 1.0,
            "seconds": time.perf_counter() - tick,
            "curve": curve,
        }
        print(f"{name}: {results[name]['accuracy']:.4f} at {results[name]['mb_up']:.2f} MB up")
    print()
    print(
        f"| scheme | final accuracy | MB up | MB down | factor up | round to {args.target:.0%} "
        f"| MB up to {args.target:.0%} | seconds |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        hit = next((p for p in r["curve"] if p["accuracy"] >= args.target), None)
        reached = f"{hit['round']} | {hit['mb_up']:.2f}" if hit else "- | -"
        print(
            f"| {name} | {r['accuracy']:.4f} | {r['mb_up']:.2f} | {r['mb_down']:.1f} "
            f"| {r['factor']:.1f} | {reached} | {r['seconds']:.0f} |"
        )
    print()
    print(json.dumps({k: v["curve"] for k, v in results.items()}))


if __name__ == "__main__":
    main()
