"""Cost of a FedAvg round under each secure aggregation protocol, against the plain round
(issue #14).

round_time.py's W1 shape: 100 clients of 600 synthetic MNIST-shaped samples, the FedAvg
paper's 2NN (199,210 parameters), batch 32, one local epoch, every client in the round, the
vectorized executor. Each contender times ``Engine.train_round`` (local training, the
protocol, the server step; no evaluation), the contenders in alternation, best of
``--repeats`` after a warm-up round. Paillier at 2048 bits would take about an hour per round
here (benchmarks/he_cost.py measures it per client); it runs only with ``--paillier``, on
``--paillier-clients`` clients, reported per client.

Prints one line per contender with its ratio to the plain round measured in the same run,
then the results as JSON.

Usage: ``python benchmarks/secure_round.py [--kinds secagg_plus,secagg,ckks] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from round_time import SEED, WORKLOADS, make_data, make_module

from fedloom.config import parse_config
from fedloom.engine.loop import Engine
from fedloom.engine.state import RunState


def engine_for(data: Any, secure: dict[str, Any], clients: int | None = None) -> Engine:
    wl = data.workload
    cfg = parse_config(
        {
            "seed": SEED,
            "model": {"name": wl.model},
            "algorithm": {"name": "fedavg"},
            "train": {
                "rounds": 100,
                "clients_per_round": clients,
                "local_epochs": 1,
                "batch_size": wl.batch_size,
                "lr": wl.lr,
            },
            "checkpoint": {"every": None},
            "monitor": {"enabled": False},
            "executor": {"kind": "vectorized"},
            "secure_aggregation": secure,
        }
    )
    engine = Engine(cfg, data.fed, make_module(wl))
    engine.executor.prepare(dict(enumerate(data.fed.clients)))
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kinds", default="secagg_plus,secagg,ckks")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--paillier", action="store_true")
    parser.add_argument("--paillier-clients", type=int, default=2)
    args = parser.parse_args()
    data = make_data(WORKLOADS["W1"])
    kinds = ["none", *args.kinds.split(",")]
    engines = {k: engine_for(data, {"kind": k}) for k in kinds}
    states = {k: e.initial_state() for k, e in engines.items()}
    times: dict[str, list[float]] = {k: [] for k in kinds}
    bytes_up: dict[str, float] = {}
    for rnd in range(args.repeats + 1):  # round 0 warms up
        for kind, engine in engines.items():
            state = RunState(states[kind].server, engine.new_store())
            start = time.perf_counter()
            engine.train_round(rnd + 1, state)
            if rnd:
                times[kind].append(time.perf_counter() - start)
            bytes_up[kind] = state.bytes_up / len(engine.train_ids)
    best = {k: min(v) for k, v in times.items()}
    out: dict[str, Any] = {
        k: {
            "seconds": best[k],
            "ratio_to_plain": best[k] / best["none"],
            "bytes_up_per_client": bytes_up[k],
        }
        for k in kinds
    }
    for k, row in out.items():
        print(
            f"{k:12s} {row['seconds']:7.2f} s/round  {row['ratio_to_plain']:5.2f}x plain  "
            f"{row['bytes_up_per_client'] / 1e3:9.1f} KB up per client",
            flush=True,
        )
    if args.paillier:
        n = args.paillier_clients
        engine = engine_for(data, {"kind": "paillier"}, clients=n)
        state = engine.initial_state()
        start = time.perf_counter()
        engine.train_round(1, state)
        seconds = time.perf_counter() - start
        out["paillier_2048"] = {"seconds_per_client": seconds / n, "clients": n}
        print(f"paillier     {seconds / n:7.1f} s per client (2048-bit, {n} clients)", flush=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
