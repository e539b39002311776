"""Cost of the training-health recording (engine/monitoring.py): the same run with
``monitor.enabled`` true and false, interleaved, in one process; reports seconds per round of
each and their ratio, and the recorded ``seconds.monitor`` share.

Setup: Fashion-MNIST, 20 clients (2 label shards each), the 2NN, 10 clients per round, 20 local
steps of batch 32, FedAvg, ``eval.every`` 1 (the worst case: every round is recorded) and 5.

    python benchmarks/monitoring_overhead.py [--rounds 10] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.algorithms.pfl_setup import pfl_config  # noqa: E402

import fedloom  # noqa: E402


def seconds_per_round(rounds: int, every: int, monitor: bool) -> tuple[float, float]:
    config = pfl_config({"name": "fedavg"}, rounds=rounds)
    config["eval"] = {"every": every}
    config["monitor"] = {"enabled": monitor}
    start = time.perf_counter()
    result = fedloom.run(config, write=False, progress=False)
    wall = (time.perf_counter() - start) / rounds
    recorded = sum(row.get("seconds", {}).get("monitor", 0.0) for row in result.history)
    return wall, recorded / rounds


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    lines = [
        "| eval.every | s/round monitoring off | s/round on | ratio on/off "
        "| recorded monitoring s/round |",
        "| --- | --- | --- | --- | --- |",
    ]
    for every in (1, 5):
        off, on, recorded = [], [], []
        for _ in range(args.repeats):  # interleaved: drift in machine load hits both
            off.append(seconds_per_round(args.rounds, every, False)[0])
            wall, rec = seconds_per_round(args.rounds, every, True)
            on.append(wall)
            recorded.append(rec)
        a, b = statistics.median(off), statistics.median(on)
        row = f"| {every} | {a:.3f} | {b:.3f} | {b / a:.3f} | {statistics.median(recorded):.3f} |"
        print(row, flush=True)
        lines.append(row)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
