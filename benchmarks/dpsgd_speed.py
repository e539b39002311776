"""Sample-level DP-SGD: the vmap backend against one client at a time (issue #14).

The shapes of round_time.py's W3 (1,000 clients of 60 samples, logistic regression, batch 10)
and W1 (100 clients of 600 samples, the 2NN, batch 32), synthetic MNIST-shaped data, FedAvg with
``privacy: {kind: sample_dp, noise_multiplier: 1.0, clip: 1.0}``, every client in the round.
Times ``Engine.train_round`` for the sequential and the vectorized executor in alternation
(best of ``--repeats`` after one warm-up round each), checks that the two give the same model,
and prints the ratio measured in this run, then the results as JSON.

Usage: ``python benchmarks/dpsgd_speed.py [--workloads W3,W1] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from round_time import SEED, WORKLOADS, make_data, make_module, threads

from fedloom.config import parse_config
from fedloom.engine.loop import Engine
from fedloom.engine.state import RunState


def engine_for(name: str, kind: str) -> tuple[Engine, RunState]:
    wl = WORKLOADS[name]
    data = make_data(wl)
    cfg = parse_config(
        {
            "seed": SEED,
            "model": {"name": wl.model},
            "algorithm": {"name": "fedavg"},
            "train": {"rounds": 100, "local_epochs": 1, "batch_size": wl.batch_size, "lr": wl.lr},
            "checkpoint": {"every": None},
            "monitor": {"enabled": False},
            "executor": {"kind": kind},
            "privacy": {"kind": "sample_dp", "noise_multiplier": 1.0, "clip": 1.0},
        }
    )
    engine = Engine(cfg, data.fed, make_module(wl))
    engine.executor.prepare(dict(enumerate(data.fed.clients)))
    return engine, engine.initial_state()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workloads", default="W3,W1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (all)")
    args = parser.parse_args()
    out = {}
    for name in args.workloads.split(","):
        contenders = {k: engine_for(name, k) for k in ("sequential", "vectorized")}
        times: dict[str, list[float]] = {k: [] for k in contenders}
        finals = {}
        with threads(args.threads):
            for rnd in range(args.repeats + 1):  # round 0 warms up
                for kind, (engine, _) in contenders.items():
                    state = RunState(contenders[kind][1].server, engine.new_store())
                    start = time.perf_counter()
                    engine.train_round(rnd + 1, state)
                    if rnd:
                        times[kind].append(time.perf_counter() - start)
                    finals[kind] = state.server["params"]
        diff = max(
            float((finals["sequential"][k] - finals["vectorized"][k]).abs().max())
            for k in finals["sequential"]
        )
        best = {k: min(v) for k, v in times.items()}
        out[name] = {
            "seconds": best,
            "vectorized_speedup": best["sequential"] / best["vectorized"],
            "max_abs_diff": diff,
            "clients": WORKLOADS[name].clients,
        }
        print(
            f"{name}: sequential {best['sequential']:.2f} s, vectorized {best['vectorized']:.2f} s"
            f" per round: {out[name]['vectorized_speedup']:.2f}x; max |diff| {diff:.1e}",
            flush=True,
        )
    print(json.dumps(out))


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
