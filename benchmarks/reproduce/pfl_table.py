"""The personalization table: every personalized algorithm (the weak-consensus family: L2SGD,
pFedMe, Ditto, APFL, pFedMac, FPFC, FedCR; FedPer, FedAvg + fine-tuning, local-only, and the
meta-learning, decoupled, function-space and label-shift algorithms) on one Fashion-MNIST
setup, in one process.

Setup (tests/algorithms/pfl_setup.py): 20 clients with 2 label shards each, 10 sampled per round,
the 2NN, 20 local steps of batch 32, 20 rounds. For each algorithm: global accuracy (its global
model on all clients' held-out data; none when it has no global model), mean and P10 of the
personalized accuracy (each client's deployed model on its own held-out data), bytes per round
(up + down) and seconds per round.

    python benchmarks/reproduce/pfl_table.py [--rounds 20] [--out benchmarks/reproduce/results]
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

RUNS: list[tuple[str, dict, dict]] = [
    ("fedavg (global on each client)", {"name": "fedavg"}, {}),
    ("local", {"name": "local"}, {}),
    ("fedavg_ft", {"name": "fedavg_ft"}, {}),
    ("l2sgd", {"name": "l2sgd", "lam": 0.1, "p": 0.1}, {"lr": 0.9, "clients_per_round": None}),
    ("pfedme", {"name": "pfedme", "lam": 1.0, "inner_lr": 0.05}, {"lr": 0.5, "local_steps": 10}),
    ("ditto", {"name": "ditto"}, {}),
    ("ditto + scaffold", {"name": "ditto", "global_algorithm": "scaffold"}, {}),
    ("apfl", {"name": "apfl"}, {}),
    ("apfl adaptive", {"name": "apfl", "adaptive_alpha": True}, {}),
    ("pfedmac", {"name": "pfedmac"}, {}),
    ("fpfc", {"name": "fpfc"}, {}),
    ("fpfc deploy cluster", {"name": "fpfc", "deploy": "cluster"}, {}),
    ("fedper", {"name": "fedper"}, {}),
    ("fedcr", {"name": "fedcr"}, {}),
    # issue #5: meta-learning, decoupling, function-space regularization, label shift
    ("perfedavg hf", {"name": "perfedavg", "variant": "hf"}, {}),
    ("perfedavg fo", {"name": "perfedavg", "variant": "fo"}, {}),
    ("reptile", {"name": "reptile"}, {}),
    ("fedrep", {"name": "fedrep", "head_steps": 10}, {}),
    ("lgfedavg", {"name": "lgfedavg"}, {}),
    ("fedproto", {"name": "fedproto"}, {}),
    ("fedntd", {"name": "fedntd"}, {}),
    ("fedlc", {"name": "fedlc"}, {}),
    ("fedgen", {"name": "fedgen"}, {}),
    ("pfedhn", {"name": "pfedhn"}, {}),
    (
        "pfedhn tuned",
        {"name": "pfedhn", "hidden_layers": 1, "momentum": 0.5, "hn_lr": 0.05},
        {},
    ),
    (
        "ditto mu cosine 1 -> 0.01",
        {"name": "ditto", "mu": 1.0, "mu_schedule": {"kind": "cosine"}},
        {},
    ),
]


def fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--only", nargs="*", help="run only these rows (by label)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/reproduce/results")
    args = parser.parse_args(argv)
    lines = [
        f"Fashion-MNIST, 20 clients x 2 label shards, 2NN, {args.rounds} rounds "
        "(tests/algorithms/pfl_setup.py)",
        "",
        "| algorithm | hyperparameters | global acc | personalized mean | P10 "
        "| MB per round (up + down) | s per round |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, algorithm, train in RUNS:
        if args.only and label not in args.only:
            continue
        config = pfl_config(algorithm, **train, rounds=args.rounds)
        config["eval"]["every"] = args.rounds
        start = time.perf_counter()
        result = fedloom.run(config, write=False, progress=False)
        seconds = (time.perf_counter() - start) / args.rounds
        final = result.summary["final"]
        comm = result.summary["communication"]
        mb = (comm["bytes_up_per_round"] + comm["bytes_down_per_round"]) / 1e6
        hyper = ", ".join(f"{k}={v}" for k, v in {**algorithm, **train}.items() if k != "name")
        row = (
            f"| {label} | {hyper or '-'} | {fmt((final['global'] or {}).get('accuracy'))} "
            f"| {fmt(final['personalized']['accuracy_mean'])} "
            f"| {fmt(final['personalized']['accuracy_p10'])} | {mb:.2f} | {seconds:.2f} |"
        )
        print(row, flush=True)
        lines.append(row)
    text = "\n".join(lines) + "\n"
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pfl_table.md").write_text(text)
    return text


if __name__ == "__main__":
    main()
