"""Auto's pick against every fixed executor, on the workloads users run most (issue #26).

For each workload, every fixed candidate (sequential at 1 and 2 threads, vectorized at 1 and
2 threads, one 1-thread worker process per core) trains the same rounds; auto's pick is
computed by ``AutoExecutor.choose`` on the workload's first round (the choice is a function of
the config, no timing: engine/auto.py). Rounds are timed with ``Engine.train_round``
(sampling, plans, client work, aggregation; no evaluation), interleaved: repeat r of every
candidate runs before repeat r+1 of any, so background load hits all alike. Read the ratios.

Usage: ``python benchmarks/auto_choice.py [--workloads fedavg_paper,flower_100,...]
[--repeats N] [--rounds R]``; ``--default-run`` also times the whole default experiment
(``fedloom run``) under auto and each fixed executor. The last line of stdout is one JSON
object. Results and the cost model's calibration: benchmarks/README.md, "Auto's cost model".
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from typing import Any

import fedloom
from fedloom.config import DEFAULT_EXPERIMENT, parse_config
from fedloom.data import load_dataset
from fedloom.engine.auto import AutoExecutor
from fedloom.engine.loop import Engine, setup_frozen
from fedloom.engine.threads import torch_threads
from fedloom.horizontal import resolve_defaults
from fedloom.models import build_model

CANDIDATES: dict[str, dict[str, Any]] = {
    "sequential/threads=1": {"kind": "sequential", "threads": 1},
    "sequential/threads=2": {"kind": "sequential", "threads": 2},
    "vectorized/threads=1": {"kind": "vectorized", "threads": 1},
    "vectorized/threads=2": {"kind": "vectorized", "threads": 2},
    "processes=2/threads=1": {"kind": "sequential", "workers": 2, "threads": 1},
    "vectorized-processes=2/threads=1": {"kind": "vectorized", "workers": 2, "threads": 1},
}


def mnist(
    clients: int,
    per_round: int | None,
    batch: int,
    lr: float,
    algo: str = "fedavg",
    model: str = "mlp",
    **algo_keys: Any,
) -> dict[str, Any]:
    return {
        "seed": 0,
        "data": {"name": "mnist", "num_clients": clients, "partition": {"kind": "iid"}},
        "model": {"name": model},
        "algorithm": {"name": algo, **algo_keys},
        "train": {
            "rounds": 1000,
            "clients_per_round": per_round,
            "local_epochs": 1,
            "batch_size": batch,
            "lr": lr,
        },
        "eval": {"every": 1000},
        "checkpoint": {"every": None},
    }


def default_experiment() -> dict[str, Any]:
    cfg = copy.deepcopy(DEFAULT_EXPERIMENT)
    cfg["checkpoint"] = {"every": None}
    cfg["train"]["rounds"] = 1000
    cfg["eval"] = {"every": 1000}
    return cfg


WORKLOADS: dict[str, dict[str, Any]] = {
    # the FedAvg paper's MNIST 2NN setting: 100 clients, C = 0.1, E = 1, B = 10
    "fedavg_paper": mnist(100, 10, 10, 0.1),
    # the Flower comparison's second setting: every client, B = 32
    "flower_100": mnist(100, None, 32, 0.05),
    "default_run": default_experiment(),
    "fedprox_b10": mnist(100, 10, 10, 0.1, "fedprox", mu=0.01),
    "ditto_b10": mnist(100, 10, 10, 0.1, "ditto", mu=0.1),
    "pfedme_b10": mnist(100, 10, 10, 0.1, "pfedme"),
    "fedavg_cnn_b10": mnist(100, 10, 10, 0.05, model="cnn"),
    "logreg_1000": mnist(1000, None, 10, 0.05, model="logreg"),
}


def build(cfg: dict[str, Any], executor: dict[str, Any]) -> Engine:
    cfg = {**cfg, "executor": executor}
    config = resolve_defaults(parse_config(cfg))
    data = load_dataset(config.data, config.seed)
    module = build_model(config.model.name, data.input_shape, data.num_outputs)
    return Engine(config, data, module)


def auto_pick(cfg: dict[str, Any]) -> tuple[str, dict[str, float]]:
    """Auto's choice for the workload's first round, and its estimates."""
    engine = build(cfg, {"kind": "auto"})
    executor = engine.executor
    assert isinstance(executor, AutoExecutor)
    state = engine.initial_state()
    clients = engine.training.sample(engine.config.seed, 1)
    tasks = engine.tasks_for_round(1, clients)
    message = engine.algorithm.server_message(state.server, 1)
    choice = executor.choose(engine.algorithm, message, tasks)
    executor.close()
    return choice, executor.estimates


class Timed:
    """One candidate's engine, warmed up, timed a round at a time."""

    def __init__(self, cfg: dict[str, Any], executor: dict[str, Any]) -> None:
        self.engine = build(cfg, executor)
        self.state = self.engine.initial_state()
        self.engine.executor.prepare(self.engine.training.data)
        self.round = 0
        self.times: list[float] = []
        self.one()  # warm-up: first calls, worker start

    def one(self) -> float:
        engine = self.engine
        self.round += 1
        with torch_threads(engine._threads()), setup_frozen():
            start = time.perf_counter()
            engine.train_round(self.round, self.state)
            return time.perf_counter() - start

    def time(self, rounds: int) -> None:
        self.times.append(sum(self.one() for _ in range(rounds)) / rounds)

    def close(self) -> None:
        self.engine.executor.close()


def measure(name: str, repeats: int, rounds: int) -> dict[str, Any]:
    cfg = WORKLOADS[name]
    choice, estimates = auto_pick(cfg)
    timed = {label: Timed(cfg, ex) for label, ex in CANDIDATES.items()}
    try:
        for _ in range(repeats):
            for t in timed.values():
                t.time(rounds)
    finally:
        for t in timed.values():
            t.close()
    medians = {label: statistics.median(t.times) for label, t in timed.items()}
    best = min(medians, key=medians.__getitem__)
    return {
        "workload": name,
        "seconds_per_round": {k: round(v, 4) for k, v in medians.items()},
        "best": best,
        "auto": choice,
        "auto_over_best": round(medians[choice] / medians[best], 3),
        "sequential_over_vectorized": round(
            min(medians["sequential/threads=1"], medians["sequential/threads=2"])
            / min(v for k, v in medians.items() if k.startswith("vectorized")),
            3,
        ),
        "estimates": {k: round(v, 4) for k, v in estimates.items()},
    }


def default_run(repeats: int) -> dict[str, Any]:
    """Whole-run wall seconds of ``fedloom run`` (the default experiment, in process, no
    files written) under auto and each fixed executor."""
    out: dict[str, list[float]] = {}
    choice = ""
    for _ in range(repeats):
        for label, executor in {"auto": {"kind": "auto"}, **CANDIDATES}.items():
            cfg = {**copy.deepcopy(DEFAULT_EXPERIMENT), "executor": executor}
            start = time.perf_counter()
            result = fedloom.run(cfg, write=False, progress=False)
            out.setdefault(label, []).append(time.perf_counter() - start)
            if label == "auto":
                choice = result.summary["executor_choice"]
    medians = {k: round(statistics.median(v), 2) for k, v in out.items()}
    fixed = {k: v for k, v in medians.items() if k != "auto"}
    best = min(fixed, key=fixed.__getitem__)
    return {
        "workload": "default_run_whole",
        "wall_seconds": medians,
        "auto": choice,
        "best": best,
        "auto_over_best": round(medians["auto"] / fixed[best], 3),
    }


def short(label: str) -> str:
    return label.replace("/threads=", "/t").replace("vectorized-processes", "vec-proc")


def table(rows: list[dict[str, Any]]) -> str:
    labels = list(CANDIDATES)
    head = f"{'workload':<16}" + "".join(f"{short(k):>15}" for k in labels)
    lines = [head + f"{'auto pick':>18}{'auto/best':>10}{'seq/vec':>9}", "-" * (len(head) + 37)]
    for row in rows:
        if "seconds_per_round" not in row:
            continue
        cells = "".join(f"{row['seconds_per_round'][k]:>15.4f}" for k in labels)
        pick = short(row["auto"])
        lines.append(
            f"{row['workload']:<16}{cells}{pick:>18}{row['auto_over_best']:>9.2f}x"
            f"{row['sequential_over_vectorized']:>8.2f}x"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per timed repeat")
    parser.add_argument("--default-run", action="store_true", help="time whole default runs")
    args = parser.parse_args(argv)
    rows = []
    for name in filter(None, args.workloads.split(",")):
        print(f"measuring {name} ...", file=sys.stderr, flush=True)
        rows.append(measure(name, args.repeats, args.rounds))
    if args.default_run:
        print("measuring the whole default run ...", file=sys.stderr, flush=True)
        rows.append(default_run(max(1, args.repeats // 2)))
    print(table(rows))
    for row in rows:
        if "wall_seconds" in row:
            print(f"default run (whole, s): {row['wall_seconds']}; auto picked {row['auto']}")
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
