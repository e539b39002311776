"""Seconds per training round of every algorithm of a sweep spec, on the vectorized executor
against the sequential one, measured side by side in one process (issue #36's speed column).

Usage (from the repository root)::

    FEDLOOM_DATA=../shared/data FEDLOOM_OFFLINE=1 PYTHONPATH=src \\
        python benchmarks/leaderboard_speed.py [--spec examples/sweeps/leaderboard_fmnist.yaml]
        [--partition dirichlet] [--algorithms fedavg,ditto] [--rounds 2] [--threads 2]
        [--json OUT]

Each algorithm of the spec's ``algorithm`` grid runs on the spec's base config with the grid's
partition named by ``--partition`` (its ``kind``), ``--rounds`` rounds, evaluation only after
the last round, no checkpoints, seed 0; once per executor, the executors taking turns
algorithm by algorithm. A run's time is the median over its rounds after the first of the
engine's training seconds (``seconds.round`` of metrics: local training, upload and
aggregation; evaluation excluded); with ``--rounds 1``, round 1's. The speedup is sequential
over vectorized. On a machine shared with other work read the ratios, not the seconds.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import yaml

import fedloom

DEFAULT_SPEC = Path("examples/sweeps/leaderboard_fmnist.yaml")


def base_configs(spec: dict[str, Any], partition: str) -> dict[str, dict[str, Any]]:
    """The run config of every algorithm of ``spec``'s grid on its ``partition`` split."""
    splits = [p for p in spec["grid"]["data.partition"] if p["kind"] == partition]
    if not splits:
        kinds = ", ".join(p["kind"] for p in spec["grid"]["data.partition"])
        raise SystemExit(f"--partition {partition}: the spec's partitions are {kinds}")
    configs = {}
    for algorithm in spec["grid"]["algorithm"]:
        config = copy.deepcopy(spec["base"])
        config["data"]["partition"] = splits[0]
        config["algorithm"] = algorithm
        configs[algorithm["name"]] = config
    return configs


def timed(config: dict[str, Any], executor: str, rounds: int, threads: int) -> dict[str, Any]:
    """One run on ``executor``: its training seconds per round and its wall time."""
    config = copy.deepcopy(config)
    config["train"]["rounds"] = rounds
    config["eval"] = {"every": rounds}
    config["checkpoint"] = {"every": None}
    config["seed"] = 0
    config["executor"] = {"kind": executor, "threads": threads}
    start = time.perf_counter()
    result = fedloom.run(config, write=False, progress=False)
    wall = time.perf_counter() - start
    per_round = [row["seconds"]["round"] for row in result.history]
    timed_rounds = per_round[1:] or per_round
    accuracy = result.history[-1].get("personalized") or {}
    return {
        "seconds_per_round": statistics.median(timed_rounds),
        "rounds": per_round,
        "wall_seconds": wall,
        "personalized_mean": accuracy.get("accuracy_mean"),
    }


def format_table(rows: dict[str, dict[str, dict[str, Any]]], executors: list[str]) -> str:
    head = " | ".join(f"{e} s/round" for e in executors)
    lines = [
        f"| algorithm | {head} | speedup |",
        "|---|" + "---:|" * (len(executors) + 1),
    ]
    for name, runs in rows.items():
        times = [runs[e]["seconds_per_round"] for e in executors]
        speedup = times[0] / times[-1] if len(times) > 1 else 1.0
        cells = " | ".join(f"{t:.2f}" for t in times)
        lines.append(f"| {name} | {cells} | {speedup:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--spec", type=Path, default=DEFAULT_SPEC)
    parser.add_argument("--partition", default="dirichlet")
    parser.add_argument("--algorithms", default=None, help="comma-separated (default: all)")
    parser.add_argument("--executors", default="sequential,vectorized")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    spec = yaml.safe_load(args.spec.read_text())
    configs = base_configs(spec, args.partition)
    if args.algorithms:
        wanted = args.algorithms.split(",")
        unknown = sorted(set(wanted) - set(configs))
        if unknown:
            raise SystemExit(f"--algorithms: not in the spec: {', '.join(unknown)}")
        configs = {name: configs[name] for name in wanted}
    executors = args.executors.split(",")
    rows: dict[str, dict[str, dict[str, Any]]] = {}
    for name, config in configs.items():
        rows[name] = {}
        for executor in executors:
            rows[name][executor] = timed(config, executor, args.rounds, args.threads)
            print(
                f"{name:>8} {executor:>10}: "
                f"{rows[name][executor]['seconds_per_round']:.2f} s/round",
                file=sys.stderr,
                flush=True,
            )
    print(format_table(rows, executors))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
