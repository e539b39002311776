"""The cold-start curves: how each algorithm serves clients that never trained (issue #5;
docs/cold_start.md: a new client's accuracy after 0, 1, 5, 20 local steps).

Setup: tests/algorithms/pfl_setup.py's Fashion-MNIST shards (2 label shards per client, the 2NN,
20 local steps of batch 32, 10 clients per round) with 25 clients, of which
``eval.new_clients: 5`` are held out of training entirely. After the last round each new client
is served the algorithm's way (engine/cold_start.py) and fine-tuned on its own training data;
the table gives the mean (and P10) accuracy over the 5 new clients after each number of steps,
and the personalized mean of the 20 training clients for reference.

    python benchmarks/reproduce/cold_start.py [--rounds 20] [--only NAME ...] [--out DIR]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.algorithms.pfl_setup import pfl_config  # noqa: E402

import fedloom  # noqa: E402

NUM_CLIENTS, NEW_CLIENTS = 25, 5
STEPS = [0, 1, 5, 20]
RUNS: list[tuple[str, dict, dict]] = [
    ("fedavg", {"name": "fedavg"}, {}),
    ("perfedavg fo", {"name": "perfedavg", "variant": "fo"}, {}),
    ("perfedavg hf", {"name": "perfedavg", "variant": "hf"}, {}),
    ("reptile", {"name": "reptile"}, {}),
    ("pfedhn", {"name": "pfedhn"}, {}),
    (
        "pfedhn tuned",
        {"name": "pfedhn", "hidden_layers": 1, "momentum": 0.5, "hn_lr": 0.05},
        {},
    ),
    ("ditto", {"name": "ditto"}, {}),
    ("fedper", {"name": "fedper"}, {}),
    ("fedrep", {"name": "fedrep"}, {}),
    ("lgfedavg", {"name": "lgfedavg"}, {}),
    ("fedproto", {"name": "fedproto"}, {}),
]


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def cold_start_config(algorithm: dict, rounds: int, **train: object) -> dict:
    config = pfl_config(algorithm, **train, rounds=rounds)
    config["data"]["num_clients"] = NUM_CLIENTS
    config["eval"] = {
        "every": rounds,
        "new_clients": NEW_CLIENTS,
        "adaptation_steps": STEPS,
    }
    return config


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--only", nargs="*", help="run only these rows (by label)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/reproduce/results")
    args = parser.parse_args(argv)
    steps = " | ".join(f"{s} steps" for s in STEPS)
    lines = [
        f"Fashion-MNIST, {NUM_CLIENTS} clients x 2 label shards ({NEW_CLIENTS} held out), 2NN, "
        f"{args.rounds} rounds (benchmarks/reproduce/cold_start.py)",
        "",
        "New clients' mean accuracy (P10 in brackets) after k fine-tuning steps on their own "
        "data, at the algorithm's adaptation step size; trained clients' personalized mean.",
        "",
        f"| algorithm | adapt lr | {steps} | trained clients | s per round |",
        "| --- | --- | " + " | ".join("---" for _ in STEPS) + " | --- | --- |",
    ]
    for label, algorithm, train in RUNS:
        if args.only and label not in args.only:
            continue
        start = time.perf_counter()
        config = cold_start_config(algorithm, args.rounds, **train)
        result = fedloom.run(config, write=False, progress=False)
        seconds = (time.perf_counter() - start) / args.rounds
        curve = result.summary["cold_start"]
        cells = " | ".join(
            f"{fmt(m)} ({fmt(p)})"
            for m, p in zip(curve["accuracy_mean"], curve["accuracy_p10"], strict=True)
        )
        trained = result.summary["final"]["personalized"]["accuracy_mean"]
        row = f"| {label} | {curve['lr']:g} | {cells} | {fmt(trained)} | {seconds:.2f} |"
        print(row, flush=True)
        lines.append(row)
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cold_start.md").write_text(text)
    return text


if __name__ == "__main__":
    main()
