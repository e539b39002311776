"""Seconds per round and peak memory of FedAvg and Ditto over a large population (issue #26).

    python benchmarks/population.py [--clients 10000 100000] [--per-round 1000] [--rounds 6]
        [--algorithms fedavg ditto] [--executors sequential vectorized processes auto]
        [--resume] [--out DIR]

Each (algorithm, population, executor) runs in a process of its own: quadratic clients
(``data.quadratic`` defaults: 5 features, 50 samples), the logreg model, ``--per-round``
clients a round, client state in memory-mapped files (``state: {storage: mmap}``) under the
run directory, a checkpoint every round and one evaluation of every client after the last
round. ``processes`` is ``executor: {kind: sequential, workers: 2}``.

Seconds per round: the median over the rounds between the first (which forks the workers,
and where auto makes its choice) and the last (which evaluates every client: reported apart
as the final round), each from one round's end to the next, checkpoint included; outside
rounds: the rest of the run (data, heterogeneity report, summary, report.html). Peak RSS:
the run's process plus its largest worker (``getrusage``: self + children). ``--resume``
also kills (SIGKILL) a Ditto run on worker processes at the largest population at the end of
its third round (the checkpoint of the second on disk) and checks that the resumed run ends
bit for bit where the uninterrupted one does.

Prints a table, then one JSON line. ``--case JSON`` runs a list of cases here, one after the
other, and prints one JSON line each (what the table runs, and what
tests/engine/test_population.py runs). See docs/population.md.
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import fedloom
from fedloom.engine.callbacks import Callback

EXECUTORS: dict[str, dict[str, Any]] = {
    "sequential": {"kind": "sequential"},
    "vectorized": {"kind": "vectorized"},
    "processes": {"kind": "sequential", "workers": 2},
    "auto": {"kind": "auto"},
}
CASE_TIMEOUT_S = 1800
"""A case that takes longer has hung (the bug of issue #26 hung rather than failed)."""


def config(case: dict[str, Any]) -> dict[str, Any]:
    """The run's config: ``case`` names the algorithm, clients, per_round, rounds, executor."""
    return {
        "seed": 0,
        "data": {"name": "quadratic", "num_clients": case["clients"]},
        "model": {"name": "logreg"},
        "algorithm": {"name": case["algorithm"]},
        "train": {
            "rounds": case["rounds"],
            "local_steps": 5,
            "batch_size": 10,
            "lr": 0.05,
            "clients_per_round": case["per_round"],
        },
        "eval": {"every": 1_000_000},  # the last round only
        "checkpoint": {"every": 1, "keep": 2},
        "state": {"storage": "mmap"},
        "executor": EXECUTORS[case["executor"]],
    }


class RoundClock(Callback):
    """When each round ended (after evaluation, before its checkpoint); optionally kills this
    process (SIGKILL, no clean-up) at the end of round ``kill_at``, once the checkpoint of the
    round before is on disk."""

    def __init__(self, kill_at: int | None = None) -> None:
        self.start = time.perf_counter()
        self.ends: list[float] = []
        self.kill_at = kill_at

    def on_run_start(self, engine: Any, state: Any) -> None:
        self.start = time.perf_counter()

    def on_round_end(self, engine: Any, state: Any, report: Any) -> None:
        if report.round == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.ends.append(time.perf_counter())

    def round_seconds(self) -> list[float]:
        marks = [self.start, *self.ends]
        return [b - a for a, b in itertools.pairwise(marks)]


def digest(result: fedloom.RunResult) -> str:
    """SHA-256 of the global model and every client's deployed model, in a fixed order."""
    h = hashlib.sha256()
    trees = [result.global_params or {}] + [
        result.client_params[c] for c in sorted(result.client_params)
    ]
    for tree in trees:
        for key in sorted(tree):
            h.update(key.encode())
            h.update(tree[key].detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def peak_rss_mb() -> tuple[float, float]:
    """(this process's peak RSS, its largest finished child's) in MB. Our own from VmHWM
    where Linux has it: ``ru_maxrss`` keeps the high-water mark of the process image that
    exec replaced, so a case spawned by a 1.8 GB pytest process reported 1.8 GB."""
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    status = Path("/proc/self/status")
    if status.exists():
        line = next(x for x in status.read_text().splitlines() if x.startswith("VmHWM:"))
        own = int(line.split()[1]) / 1024
    children = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return own, children


def run_case(case: dict[str, Any], baseline: float) -> dict[str, Any]:
    """One run in this process (``case``: config's keys, ``out`` the run directory, and
    optionally ``kill_at`` or ``resume``); what the table reports. ``baseline``: this
    process's peak RSS before its first run (python, torch and fedloom loaded)."""
    start = time.perf_counter()
    clock = RoundClock(case.get("kill_at"))
    if case.get("resume"):
        result = fedloom.run(resume=case["out"], progress=False, callbacks=[clock])
    else:
        result = fedloom.run(config(case), out=case["out"], progress=False, callbacks=[clock])
    wall = time.perf_counter() - start
    seconds = clock.round_seconds()
    own, children = peak_rss_mb()
    return {
        **{k: case[k] for k in ("algorithm", "clients", "per_round", "rounds", "executor")},
        "executor_choice": result.summary["executor_choice"],
        "round_seconds": [round(s, 3) for s in seconds],
        "seconds_per_round": round(statistics.median(seconds[1:-1] or seconds), 3),
        "final_round_seconds": round(seconds[-1], 3),
        "outside_rounds_seconds": round(wall - sum(seconds), 1),
        "peak_rss_mb": round(own + children, 1),
        "peak_rss_self_mb": round(own, 1),
        "peak_rss_workers_mb": round(children, 1),
        "baseline_rss_mb": round(baseline, 1),
        "final": result.summary["final"]["global"],
        "digest": digest(result),
    }


def spawn(
    cases: list[dict[str, Any]], timeout: float = CASE_TIMEOUT_S
) -> list[dict[str, Any]] | None:
    """``run_case`` of each case, in order, in one fresh process (the peak memory reported
    after a case is that process's so far); None if the process was killed."""
    proc = subprocess.run(
        [sys.executable, __file__, "--case", json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode == -signal.SIGKILL:
        return None
    if proc.returncode != 0:
        raise RuntimeError(f"cases {cases} failed:\n{proc.stderr[-4000:]}")
    return [json.loads(line) for line in proc.stdout.strip().splitlines()[-len(cases) :]]


def resume_check(clients: int, per_round: int, rounds: int, root: Path) -> dict[str, Any]:
    """Ditto on worker processes: killed at the end of round 3 (checkpoint of round 2 on
    disk), resumed, against the uninterrupted run."""
    case = {"algorithm": "ditto", "clients": clients, "per_round": per_round, "rounds": rounds}
    case["executor"] = "processes"
    (full,) = spawn([{**case, "out": str(root / "full")}]) or [None]
    killed = spawn([{**case, "out": str(root / "killed"), "kill_at": 3}])
    (resumed,) = spawn([{**case, "out": str(root / "killed"), "resume": True}]) or [None]
    assert full is not None and killed is None and resumed is not None
    return {
        "clients": clients,
        "killed_after_round": 3,
        "identical": full["digest"] == resumed["digest"] and full["final"] == resumed["final"],
        "resumed_peak_rss_mb": resumed["peak_rss_mb"],
    }


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| algorithm | clients | executor | choice | s/round | final round s | outside rounds s "
        "| peak RSS MB (self + workers) |"
    )
    lines = [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        lines.append(
            f"| {r['algorithm']} | {r['clients']:,} | {r['executor']} | {r['executor_choice']} "
            f"| {r['seconds_per_round']:.3f} | {r['final_round_seconds']:.2f} "
            f"| {r['outside_rounds_seconds']:.1f} | {r['peak_rss_mb']:.0f} "
            f"({r['peak_rss_self_mb']:.0f} + {r['peak_rss_workers_mb']:.0f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10_000, 100_000])
    parser.add_argument("--per-round", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--algorithms", nargs="+", default=["fedavg", "ditto"])
    parser.add_argument("--executors", nargs="+", default=list(EXECUTORS), choices=EXECUTORS)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--out", type=Path, help="run directories (default: a temporary one)")
    parser.add_argument("--case", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.case:
        baseline, _ = peak_rss_mb()
        for case in json.loads(args.case):
            print(json.dumps(run_case(case, baseline)), flush=True)
        return
    with tempfile.TemporaryDirectory(prefix="fedloom-population-") as tmp:
        root = args.out or Path(tmp)
        rows = []
        for algorithm in args.algorithms:
            for clients in args.clients:
                for executor in args.executors:
                    name = f"{algorithm}-{clients}-{executor}"
                    case = {"algorithm": algorithm, "clients": clients, "executor": executor}
                    case |= {"per_round": args.per_round, "rounds": args.rounds}
                    (row,) = spawn([{**case, "out": str(root / name)}]) or [None]
                    assert row is not None
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if k != "digest"}), flush=True)
        print(table(rows))
        out: dict[str, Any] = {"cases": rows, "torch": torch.__version__, "cpus": os.cpu_count()}
        if args.resume:
            out["resume"] = resume_check(max(args.clients), args.per_round, args.rounds, root)
            print(f"resume: {out['resume']}")
        print(json.dumps(out))


if __name__ == "__main__":
    main()
