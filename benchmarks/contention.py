"""Seconds per round on a quiet machine and beside a busy process, for fedloom's OpenMP wait
and thread policy and for the old one (issue #13, item 3).

Workload: the issue's MNIST 2NN round, FedAvg with 10 clients x 60 local steps of batch 32 on
synthetic MNIST-shaped data (the timing depends on shapes only), one executor. Every
measurement runs in a fresh process, because OpenMP reads its wait policy once, when torch
loads it. Neighbours ("background"):

- ``quiet``: none;
- ``spin``: ``python -c 'while True: pass'``, one core taken;
- ``torch``: another torch process with libgomp's default wait policy and all cores, running
  small matmuls (an MLP's forward pass) in a loop: another FL simulation, say.

Policies:

- ``old``: what fedloom did before: libgomp's default wait (spin about 3 ms before sleeping;
  the run imports torch before fedloom, so OpenMP starts before fedloom sets its policy) and
  torch's default thread count (all cores);
- ``fedloom``: today's defaults: no OpenMP variable set (fedloom then sets
  ``OMP_WAIT_POLICY=PASSIVE``) and ``executor.threads: null``;
- ``passive/threads=all``, ``old-wait/threads=1``, ``spin10k/threads=all`` and
  ``spin100k/threads=all`` (``GOMP_SPINCOUNT`` 10,000 and 100,000): one change at a time.

Usage: ``python benchmarks/contention.py [--rounds 5] [--timeout 180] [--executor sequential]
[--policies old,fedloom] [--backgrounds quiet,spin,torch]``. The last line of stdout is one
JSON object; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

CLIENTS = 10
STEPS = 60
BATCH = 32
MODEL = "mlp"


@dataclass(frozen=True)
class Policy:
    name: str
    env: dict[str, str]
    """OpenMP variables set for the run (fedloom fills in its default where none is)."""
    threads: int | None
    """``executor.threads`` (None: fedloom's default)."""
    torch_first: bool = False
    """Import torch before fedloom: OpenMP starts with libgomp's own default wait."""


CORES = os.cpu_count() or 1
OPENMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
POLICIES = {
    p.name: p
    for p in (
        Policy("old", {}, CORES, torch_first=True),
        Policy("fedloom", {}, None),
        Policy("passive/threads=all", {"OMP_WAIT_POLICY": "PASSIVE"}, CORES),
        Policy("spin10k/threads=all", {"GOMP_SPINCOUNT": "10000"}, CORES),
        Policy("spin100k/threads=all", {"GOMP_SPINCOUNT": "100000"}, CORES),
        Policy("old-wait/threads=1", {}, 1, torch_first=True),
    )
}
NEIGHBOUR_TORCH = """
import torch
x, w = torch.randn(32, 784), torch.randn(784, 200)
while True:
    (x @ w).relu_().sum()
"""
BACKGROUNDS = {
    "quiet": None,
    "spin": "while True: pass",
    "torch": NEIGHBOUR_TORCH,
}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def child(args: argparse.Namespace) -> None:
    """Run 1 + ``rounds`` rounds here; print the timed rounds' seconds as JSON."""
    if args.torch_first:  # OpenMP loads with the environment as it is, before fedloom sets it
        importlib.import_module("torch")
    importlib.import_module("fedloom")  # else first: it sets the policy before torch loads
    import torch

    import fedloom
    from fedloom.data.federated import from_arrays
    from fedloom.engine.threads import openmp_wait_policy

    gen = torch.Generator().manual_seed(0)
    samples = args.steps * BATCH
    data = from_arrays(
        train=[
            (torch.rand(samples, 1, 28, 28, generator=gen), torch.randint(0, 10, (samples,)))
            for _ in range(args.clients)
        ],
        test=[(torch.rand(10, 1, 28, 28), torch.randint(0, 10, (10,)))] * args.clients,
        name="synthetic-mnist",
    )
    cfg = {
        "seed": 0,
        "model": {"name": args.model},
        "algorithm": {"name": "fedavg"},
        "train": {
            "rounds": args.rounds + 1,
            "local_steps": args.steps,
            "batch_size": BATCH,
            "lr": 0.05,
        },
        "eval": {"every": 1},  # rows carry each round's training seconds
        "monitor": {"enabled": False},
        "executor": {"kind": args.executor, "threads": args.threads},
    }
    result = fedloom.run(cfg, data=data, write=False, progress=False)
    seconds = [row["seconds"]["round"] for row in result.history[1:]]
    print(
        json.dumps(
            {
                "seconds": seconds,
                "choice": result.summary.get("executor_choice"),
                "wait_env": openmp_wait_policy(),
            }
        )
    )


def measure(policy: Policy, background: str, args: argparse.Namespace) -> dict[str, object]:
    """One fresh process running the workload under ``policy`` beside ``background``."""
    env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS} | policy.env
    env["OMP_DISPLAY_ENV"] = "VERBOSE"  # libgomp prints its settings: the policy in force
    neighbour = None
    if BACKGROUNDS[background] is not None:
        quiet_env = {k: v for k, v in os.environ.items() if k not in OPENMP_VARS}
        neighbour = subprocess.Popen([sys.executable, "-c", BACKGROUNDS[background]], env=quiet_env)
        time.sleep(1.0)  # let it start (and torch load) before the run
    cmd = [sys.executable, __file__, "--child", "--executor", args.executor]
    cmd += ["--rounds", str(args.rounds), "--model", args.model]
    cmd += ["--clients", str(args.clients), "--steps", str(args.steps)]
    if policy.threads is not None:
        cmd += ["--threads", str(policy.threads)]
    if policy.torch_first:
        cmd.append("--torch-first")
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired:
        # start-up plus rounds + 1 rounds took longer: a lower bound of the mean round
        return {"timeout_s": args.timeout, "mean_s_above": args.timeout / (args.rounds + 1)}
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"{policy.name} beside {background} failed:\n{proc.stderr}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    seconds = out.pop("seconds")
    shown = [line.split("'")[1] for line in proc.stderr.splitlines() if "GOMP_SPINCOUNT =" in line]
    out["libgomp_spincount"] = shown[0] if shown else None
    return {
        "mean_s": statistics.fmean(seconds),
        "median_s": statistics.median(seconds),
        "max_s": max(seconds),
        "rounds_s": seconds,
        **out,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="timed rounds per measurement")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per measurement")
    parser.add_argument("--executor", default="sequential")
    parser.add_argument("--model", default=MODEL, help="mlp (the 2NN), cnn, logreg")
    parser.add_argument("--clients", type=int, default=CLIENTS)
    parser.add_argument("--steps", type=int, default=STEPS, help="local steps per client")
    parser.add_argument("--policies", default="old,fedloom")
    parser.add_argument("--backgrounds", default="quiet,spin,torch")
    parser.add_argument("--threads", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--torch-first", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    policies = [POLICIES[p] for p in args.policies.split(",")]
    backgrounds = args.backgrounds.split(",")
    results: dict[str, dict[str, object]] = {}
    loads = {"start": os.getloadavg()[0]}
    log(f"{CORES} cores, load average {loads['start']:.2f} at the start")
    for background in backgrounds:
        for policy in policies:  # interleaved: drifting background load hits every policy
            r = measure(policy, background, args)
            results.setdefault(policy.name, {})[background] = r
            shown = (
                f"{r['mean_s']:.3f} s/round"
                if "mean_s" in r
                else f"> {r['mean_s_above']:.0f} s/round (timed out)"
            )
            log(f"{policy.name:>22} beside {background:<6} {shown}")
    loads["end"] = os.getloadavg()[0]
    print(f"\nload average {loads['start']:.2f} at the start, {loads['end']:.2f} at the end")
    print(f"{'policy':>22} " + " ".join(f"{b:>14}" for b in backgrounds))
    for name, row in results.items():
        quiet = row.get("quiet", {}).get("mean_s")
        cells = []
        for background in backgrounds:
            r = row[background]
            if "mean_s" not in r:
                cells.append(f"{'>' + format(r['mean_s_above'], '.0f'):>8}{'':>6}")
                continue
            ratio = f" ({r['mean_s'] / quiet:.1f}x)" if quiet and background != "quiet" else ""
            cells.append(f"{r['mean_s']:>8.3f}{ratio:>6}")
        print(f"{name:>22} " + " ".join(cells))
    for row in results.values():
        quiet = row.get("quiet", {}).get("mean_s")
        for r in row.values():
            if quiet and "mean_s" in r:
                r["ratio_to_quiet"] = r["mean_s"] / quiet
    setting = {k: getattr(args, k) for k in ("executor", "model", "clients", "steps", "rounds")}
    print(json.dumps({**setting, "cores": CORES, "load_average": loads, "results": results}))


if __name__ == "__main__":
    main()
