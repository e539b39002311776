"""Seconds per round of the same FedAvg run on fedloom's own engine and on Flower's simulation
engine through the adapter (fedloom.flower), measured in one process, reported as a ratio.

Usage: ``python benchmarks/flower.py [--rounds R] [--clients N] [--per-round K]
[--dataset mnist|digits] [--client-cpus C] [--num-cpus P]``. Both runs use the same config
(sequential executor: the solver a Flower node runs); a round is timed from one evaluated
round's ``wall_seconds`` to the next (evaluation, the same on both sides, is in it). The
first round is reported apart: on Flower it also pays every Ray actor's import of fedloom and
load of the dataset. ``end_to_end_s`` adds Flower's start and shutdown of Ray. The last line of
stdout is one JSON object; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

import fedloom
from fedloom.engine.shell import RunResult
from fedloom.flower import run_simulation


def config(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "seed": 0,
        "data": {
            "name": args.dataset,
            "num_clients": args.clients,
            "partition": {"kind": "iid"},
        },
        "model": {"name": "mlp"},
        "algorithm": {"name": "fedavg"},
        "train": {
            "rounds": args.rounds,
            "clients_per_round": args.per_round,
            "local_epochs": 1,
            "batch_size": 32,
            "lr": 0.05,
        },
        "eval": {"every": 1},
        "executor": {"kind": "sequential", "threads": 1},
    }


def round_seconds(result: RunResult) -> list[float]:
    """Seconds of each round, from the evaluated rows' cumulative ``wall_seconds``."""
    walls = [row["wall_seconds"] for row in result.history]
    return [b - a for a, b in zip([0.0, *walls], walls, strict=False)]


def describe(result: RunResult, end_to_end: float) -> dict[str, Any]:
    rounds = round_seconds(result)
    return {
        "first_round_s": round(rounds[0], 3),
        "seconds_per_round": round(statistics.median(rounds[1:] or rounds), 3),
        "end_to_end_s": round(end_to_end, 1),
        "accuracy": result.summary["final"]["global"]["accuracy"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--per-round", type=int, default=10)
    parser.add_argument("--dataset", default="mnist", choices=["mnist", "digits"])
    parser.add_argument("--client-cpus", type=float, default=1.0)
    parser.add_argument("--num-cpus", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    cfg = config(args)

    tick = time.perf_counter()
    engine = fedloom.run(cfg, write=False, progress=False)
    engine_row = describe(engine, time.perf_counter() - tick)

    tick = time.perf_counter()
    flower = run_simulation(cfg, num_cpus=args.num_cpus, client_cpus=args.client_cpus)
    flower_row = describe(flower, time.perf_counter() - tick)

    same = max(
        (engine.global_params[k] - v).abs().max().item()  # type: ignore[index]
        for k, v in (flower.global_params or {}).items()
    )
    report = {
        "setting": {
            **{k: v for k, v in vars(args).items()},
            "load_average": os.getloadavg()[0],
        },
        "engine": engine_row,
        "flower": flower_row,
        "ratio_per_round": round(
            flower_row["seconds_per_round"] / engine_row["seconds_per_round"], 2
        ),
        "max_param_diff": same,
    }
    print(
        f"FedAvg {args.dataset} 2NN, {args.clients} clients, {args.per_round}/round: "
        f"engine {engine_row['seconds_per_round']:.3f} s/round, Flower simulation "
        f"{flower_row['seconds_per_round']:.3f} s/round ({report['ratio_per_round']}x); "
        f"first round {engine_row['first_round_s']:.2f} vs {flower_row['first_round_s']:.2f} s; "
        f"end to end {engine_row['end_to_end_s']} vs {flower_row['end_to_end_s']} s"
    )
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
