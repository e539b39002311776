"""Time to target accuracy on the virtual clock: FedAsync and FedBuff against synchronous FedAvg
with 50% stragglers (issue #20, part 3; docs/asynchrony.md).

Setting: MNIST, the FedAvg paper's 2NN, 50 clients (Dirichlet(1.0) labels), 10 local steps of
batch 32 at lr 0.05 per update. Half the clients (chosen once with the seed) take 10 time units
per local step, the others 1; each job's time varies by a lognormal factor (jitter 0.2). Ten
clients train at a time in every method: synchronous FedAvg samples 10 per round and waits for
the slowest; FedAsync (alpha 0.6) and FedBuff (K = 5, eta_g = 1) keep 10 in flight, staleness
s(d) = (d + 1)^-0.5. Each method runs for about 1.3x the virtual time budget (its server
steps sized from the expected time per step); reported: the virtual time at which the global
model first reaches the target accuracy (evaluated about every ``--eval-every-time`` units),
the accuracy at fractions of the budget, and the client updates applied.

The target, 0.90 global test accuracy, is where synchronous FedAvg's curve flattens in this
setting (0.86 at t = 4000, 0.90 near t = 9400) while still below every method's plateau, so
the time to reach it measures speed, not the final level.

Usage: ``FEDLOOM_DATA=../shared/data python benchmarks/asynchrony.py [--budget 8000]
[--target 0.9]``; about 7 minutes on 2 busy cores; prints markdown tables, then the results
as JSON on the last line.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from typing import Any

import torch

import fedloom

SPEEDS = {"kind": "stragglers", "fraction": 0.5, "slowdown": 10.0, "jitter": 0.2}
CONCURRENCY = 10
STEPS = 10
BUFFER = 5

METHODS: dict[str, dict[str, Any]] = {
    "FedAvg (sync, waits for stragglers)": {"kind": "none"},
    "FedAsync (alpha 0.6)": {"kind": "fedasync", "alpha": 0.6},
    f"FedBuff (K {BUFFER})": {"kind": "fedbuff", "buffer": BUFFER},
}


def time_per_step(kind: str) -> float:
    """Expected virtual time between server steps: a synchronous round waits for its slowest
    client (nearly always a straggler among 10); asynchronous clients arrive at rate
    concurrency / E[job time] (clients are drawn uniformly from the idle ones), one server
    step per arrival (FedAsync) or per K arrivals (FedBuff)."""
    if kind == "none":
        return STEPS * SPEEDS["slowdown"]
    f, slow = SPEEDS["fraction"], SPEEDS["slowdown"]
    between_arrivals = STEPS * (f * slow + 1 - f) / CONCURRENCY
    return between_arrivals * (BUFFER if kind == "fedbuff" else 1)


MARGIN = 1.3
"""Server steps run: MARGIN x budget / time_per_step, so every method passes the budget."""


def config(
    asynchrony: dict[str, Any], rounds: int, every: int, seed: int, alpha: float = 1.0
) -> dict[str, Any]:
    return {
        "seed": seed,
        "data": {
            "name": "mnist",
            "num_clients": 50,
            "partition": {"kind": "dirichlet", "alpha": alpha},
        },
        "model": {"name": "mlp"},
        "algorithm": {"name": "fedavg"},
        "train": {
            "rounds": rounds,
            "clients_per_round": CONCURRENCY,
            "local_steps": STEPS,
            "batch_size": 32,
            "lr": 0.05,
        },
        "eval": {"every": every},
        "monitor": {"enabled": False},
        "executor": {"kind": "sequential"},
        "asynchrony": {**asynchrony, "speeds": SPEEDS},
    }


def measure(name: str, asynchrony: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    per_step = time_per_step(asynchrony["kind"])
    rounds = math.ceil(MARGIN * args.budget / per_step)
    every = max(1, round(args.eval_every_time / per_step))
    tick = time.perf_counter()
    result = fedloom.run(
        config(asynchrony, rounds, every, args.seed, args.alpha), write=False, progress=False
    )
    curve = [(row["clock"], row["global"]["accuracy"]) for row in result.history]
    reached = next((t for t, a in curve if a >= args.target), None)
    return {
        "method": name,
        "time_to_target": reached,
        "accuracy_at_budget": accuracy_at(curve, args.budget),
        "best_accuracy": max(a for _, a in curve),
        "clock_end": result.summary["clock"],
        "server_steps": rounds,
        "updates": (result.summary.get("asynchrony") or {}).get("updates", rounds * CONCURRENCY),
        "staleness_mean": (result.summary.get("asynchrony") or {}).get("staleness_mean", 0.0),
        "wall_seconds": time.perf_counter() - tick,
        "curve": curve,
    }


def accuracy_at(curve: list[tuple[float, float]], t: float) -> float | None:
    before = [a for time_, a in curve if time_ <= t]
    return before[-1] if before else None


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--budget", type=float, default=8000.0, help="virtual time units")
    parser.add_argument("--target", type=float, default=0.9, help="global test accuracy")
    parser.add_argument("--eval-every-time", type=float, default=100.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--alpha", type=float, default=1.0, help="Dirichlet label skew")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = []
    for name, asynchrony in METHODS.items():
        results.append(measure(name, asynchrony, args))
        print(f"done: {name} in {results[-1]['wall_seconds']:.0f} s", flush=True)
    sync = results[0]["time_to_target"]
    print(f"\nTarget {args.target:.2f} global test accuracy, budget {args.budget:g} time units\n")
    print(
        "| method | time to target | speed-up vs sync | accuracy at budget | best | updates "
        "| mean staleness |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        t, at_budget = r["time_to_target"], r["accuracy_at_budget"]
        speedup = f"{sync / t:.2f}x" if t and sync else "-"
        print(
            f"| {r['method']} | {f'{t:.0f}' if t is not None else 'not reached'} | {speedup} "
            f"| {f'{at_budget:.3f}' if at_budget is not None else '-'} "
            f"| {r['best_accuracy']:.3f} | {r['updates']} | {r['staleness_mean']:.2f} |"
        )
    times = [args.budget * f for f in (0.125, 0.25, 0.5, 1.0)]
    print("\nGlobal test accuracy at virtual time t (last evaluation at or before t)\n")
    print("| method | " + " | ".join(f"t = {t:g}" for t in times) + " |")
    print("| --- |" + " --- |" * len(times))
    for r in results:
        cells = [accuracy_at(r["curve"], t) for t in times]
        print(
            f"| {r['method']} | "
            + " | ".join(f"{a:.3f}" if a is not None else "-" for a in cells)
            + " |"
        )
    print(json.dumps({"args": vars(args), "results": results}))
    return results


if __name__ == "__main__":
    main()
