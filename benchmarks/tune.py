"""fedloom tune on a federated quadratic with a known best learning rate (issue #20, part 1).

Problem (tests/tune/oracle.py): 10 least-squares clients, FedAvg with every client each round
and one full-batch local step = gradient descent on the pooled loss, R rounds, 20% validation.
The validation loss after R rounds is a closed form of lr, so its minimiser lr* is known.

Contenders, each over seeds 0..S-1 (the sampler's seed; the problem is fixed):
- grid: G log-spaced lrs in [1e-3, 1], every run to R rounds (G x R rounds);
- TPE + Hyperband, TPE + successive halving, TPE without pruning: T trials each.
Reported: the best lr found / lr*, its validation loss / the optimum's, rounds spent.

    python benchmarks/tune.py [--trials 30] [--rounds 8] [--grid 13] [--seeds 5]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
from tests.tune.oracle import best_lr, quadratic_config, validation_loss  # noqa: E402

import fedloom  # noqa: E402
from fedloom.engine.nonfinite import DivergenceError  # noqa: E402
from fedloom.tune import parse_space, tune  # noqa: E402

SPACE = {"train.lr": {"kind": "float", "low": 0.001, "high": 1.0, "log": True}}


def grid(raw: dict, points: int) -> dict:
    """Every lr of a log grid run to the end with fedloom; the best by validation loss."""
    best, rounds = None, 0
    for lr in np.geomspace(1e-3, 1.0, points):
        cfg = {**raw, "train": {**raw["train"], "lr": float(lr)}}
        try:
            result = fedloom.run(cfg, write=False, progress=False)
            loss = result.history[-1]["validation"]["global"]["loss"]
        except DivergenceError:
            loss = math.inf
        rounds += raw["train"]["rounds"]
        if best is None or loss < best[1]:
            best = (float(lr), loss)
    assert best is not None
    return {"lr": best[0], "rounds": rounds}


def search(raw: dict, trials: int, pruner: str, seed: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        result = tune(
            raw, parse_space(SPACE), trials, out=Path(tmp) / "s", pruner=pruner, seed=seed
        )
    return {
        "lr": result.summary["best"]["params"]["train.lr"],
        "rounds": result.summary["rounds_spent"],
    }


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--grid", type=int, default=13)
    parser.add_argument("--seeds", type=int, default=5)
    args = parser.parse_args(argv)
    raw = quadratic_config(args.rounds)
    optimum = best_lr(raw)
    best_loss = float(validation_loss(raw, np.array([optimum]))[0])

    def score(found: dict) -> dict:
        loss = float(validation_loss(raw, np.array([found["lr"]]))[0])
        return {**found, "ratio": found["lr"] / optimum, "loss_ratio": loss / best_loss}

    out: dict = {"lr_optimum": optimum, "loss_optimum": best_loss, "rounds": args.rounds}
    start = time.perf_counter()
    out["grid"] = score(grid(raw, args.grid))
    out["grid"]["seconds"] = time.perf_counter() - start
    print(f"lr* = {optimum:.4g} (validation loss {best_loss:.3g})", file=sys.stderr)
    lines = [
        f"{'contender':<22} {'lr/lr* (min..max)':>20} {'loss/loss* (median)':>20} "
        f"{'rounds (mean)':>14} {'of no pruning':>14}",
        f"{'grid (' + str(args.grid) + ' lrs)':<22} {out['grid']['ratio']:>20.3f} "
        f"{out['grid']['loss_ratio']:>20.3f} {out['grid']['rounds']:>14} "
        f"{out['grid']['rounds'] / (args.trials * args.rounds):>14.0%}",
    ]
    for pruner in ("hyperband", "sha", "none"):
        runs = []
        start = time.perf_counter()
        for seed in range(args.seeds):
            runs.append(score(search(raw, args.trials, pruner, seed)))
            print(f"{pruner} seed {seed}: {runs[-1]}", file=sys.stderr)
        ratios = [r["ratio"] for r in runs]
        rounds = statistics.mean(r["rounds"] for r in runs)
        out[pruner] = {
            "runs": runs,
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
            "loss_ratio_median": statistics.median(r["loss_ratio"] for r in runs),
            "rounds_mean": rounds,
            "rounds_share": rounds / (args.trials * args.rounds),
            "seconds_per_search": (time.perf_counter() - start) / args.seeds,
        }
        o = out[pruner]
        lines.append(
            f"{'TPE + ' + pruner:<22} {o['ratio_min']:>9.3f}..{o['ratio_max']:<9.3f} "
            f"{o['loss_ratio_median']:>20.3f} {rounds:>14.1f} {o['rounds_share']:>14.0%}"
        )
    print("\n".join(lines))
    line = json.dumps(out)
    print(line)
    return line


if __name__ == "__main__":
    main()
