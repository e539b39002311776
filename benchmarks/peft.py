"""Federated PEFT on a pretrained transformer: the strategy comparison of docs/peft.md.

all-MiniLM-L6-v2 (frozen) + LoRA r=8 alpha=16 on query/value, BBC News headlines, 10 clients
with Dirichlet(0.3) label skew, each client 70/30 train/test, 1 local epoch of SGD a round,
classifier head shared by every federated strategy. Reported per strategy: personalized
accuracy after every round, bytes up/down per round, seconds per round. Then seconds per
round of the sequential vs the vectorized executor (same run), and the central LoRA baseline
(the ``centralized`` algorithm: one epoch over the pooled training data).

    .venv/bin/python benchmarks/peft.py                      # all, ~10 min on 2 free cores
    .venv/bin/python benchmarks/peft.py --strategies local,a,both --rounds 3
    .venv/bin/python benchmarks/peft.py --model tiny_bert --rounds 2   # smoke run
    .venv/bin/python benchmarks/peft.py --strategies "" --skip-timing --skip-central \
        --algorithms fedavg,ditto,fedrep --optimizers sgd:0.1,adamw:0.003,adamw:0.01

Runs are written under --out (default runs/peft-bench/<strategy>), so that
``fedloom compare runs/peft-bench/*`` shows them side by side. Progress goes to stderr; the
last stdout line is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

import fedloom

STRATEGIES: dict[str, dict[str, Any]] = {
    "local": {"algorithm": "local", "peft": {"share": "both"}},
    "a": {"peft": {"share": "a"}},  # FedSA-LoRA
    "b": {"peft": {"share": "b"}},
    "both": {"peft": {"share": "both"}},  # FedIT
    "ffa": {"peft": {"share": "ffa"}},
    "flora": {"peft": {"share": "flora"}},
    "fedex": {"peft": {"share": "fedex"}},
    "hetlora": {"peft": {"share": "both", "rank_by_size": True}},
    "adapter": {"peft": {"kind": "adapter", "bottleneck": 16}},
    "prompt": {"peft": {"kind": "prompt", "prompt_length": 8, "personal_prompt_length": 4}},
    "prompt_mean": {
        "peft": {
            "kind": "prompt",
            "prompt_length": 8,
            "personal_prompt_length": 4,
            "aggregation": "mean",
        }
    },
}
DEFAULT = "local,a,b,both,ffa,flora,fedex,hetlora"


def config(
    model: str, strategy: str, rounds: int, lr: float, executor: str, max_length: int = 24
) -> dict[str, Any]:
    spec = STRATEGIES[strategy]
    return {
        "seed": 0,
        "data": {
            "name": "bbc_news",
            "num_clients": 10,
            "max_length": max_length,
            "test_fraction": 0.3,
            "partition": {"kind": "dirichlet", "alpha": 0.3},
        },
        "model": {"name": model},
        "peft": {
            "kind": "lora",
            "r": 8,
            "alpha": 16,
            "targets": ["query", "value"],
            **spec["peft"],
        },
        "algorithm": {"name": spec.get("algorithm", "fedavg")},
        "train": {"rounds": rounds, "local_epochs": 1, "batch_size": 32, "lr": lr},
        "eval": {"every": 1},
        "checkpoint": {"every": rounds},
        "monitor": {"enabled": False},
        "executor": {"kind": executor},
    }


ALGORITHMS: dict[str, dict[str, Any]] = {
    "fedavg": {"name": "fedavg"},
    "ditto": {"name": "ditto"},  # mu 0.1, personal steps = the global update's
    "fedrep": {"name": "fedrep", "head_epochs": 1},  # 1 head epoch (paper: 10; 10x the cost)
}


def algorithm_config(
    model: str, algorithm: str, optimizer: str, lr: float, rounds: int, max_length: int
) -> dict[str, Any]:
    """FedSA-LoRA (share a) under ``algorithm`` with the local ``optimizer`` at ``lr``."""
    cfg = config(model, "a", rounds, lr, "sequential", max_length)
    cfg["algorithm"] = dict(ALGORITHMS[algorithm])
    cfg["train"]["optimizer"] = optimizer
    return cfg


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(cfg: dict[str, Any], out: Path | None) -> fedloom.RunResult:
    if out is not None and out.exists():
        shutil.rmtree(out)
    return fedloom.run(cfg, out=out, write=out is not None, progress=False)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="minilm")
    ap.add_argument("--strategies", default=DEFAULT)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--max-length", type=int, default=24)
    ap.add_argument("--timing-rounds", type=int, default=1)
    ap.add_argument("--timing-repeats", type=int, default=1)
    ap.add_argument("--out", default="runs/peft-bench")
    ap.add_argument("--skip-central", action="store_true")
    ap.add_argument(
        "--algorithms", default="", help="FedSA under these algorithms, e.g. fedavg,ditto,fedrep"
    )
    ap.add_argument("--optimizers", default="sgd:0.1,adamw:0.003", help="optimizer:lr,...")
    ap.add_argument("--skip-timing", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = Path(args.out)
    results: dict[str, Any] = {
        "model": args.model,
        "rounds": args.rounds,
        "lr": args.lr,
        "strategies": {},
    }
    print(
        f"{'strategy':<10} {'personalized accuracy per round':<34} {'up/round':>10} "
        f"{'down/round':>11} {'s/round':>8}"
    )
    for name in filter(None, args.strategies.split(",")):
        log(f"[peft] {name} ...")
        res = run(
            config(args.model, name, args.rounds, args.lr, "sequential", args.max_length),
            out / name,
        )
        acc = [round(h["personalized"]["accuracy_mean"], 3) for h in res.history]
        comm = res.summary["communication"]
        row = {
            "personalized_accuracy": acc,
            "bytes_up_per_round": comm["bytes_up_per_round"],
            "bytes_down_per_round": comm["bytes_down_per_round"],
            "seconds_per_round": round(res.summary["seconds_per_round"], 2),
        }
        results["strategies"][name] = row
        print(
            f"{name:<10} {acc!s:<34} {row['bytes_up_per_round']:>10.0f} "
            f"{row['bytes_down_per_round']:>11.0f} {row['seconds_per_round']:>8.2f}",
            flush=True,
        )
    for name in filter(None, args.algorithms.split(",")):
        for spec in args.optimizers.split(","):
            optimizer, lr = spec.split(":")
            log(f"[peft] FedSA + {name}, {optimizer} lr {lr} ...")
            cfg = algorithm_config(
                args.model, name, optimizer, float(lr), args.rounds, args.max_length
            )
            res = run(cfg, out / f"a-{name}-{optimizer}-{lr}")
            acc = [round(h["personalized"]["accuracy_mean"], 3) for h in res.history]
            key = f"a/{name}/{optimizer}/{lr}"
            results.setdefault("algorithms", {})[key] = {
                "personalized_accuracy": acc,
                "seconds_per_round": round(res.summary["seconds_per_round"], 2),
            }
            print(f"FedSA + {name:<7} {optimizer:<6} lr {lr:<7} {acc!s}", flush=True)
    if not args.skip_timing:  # one strategy on both executors; interleaved against drift
        seconds: dict[str, list[float]] = {"sequential": [], "vectorized": []}
        for _ in range(args.timing_repeats):
            for ex in seconds:
                log(f"[peft] timing {ex} ...")
                cfg = config(args.model, "a", args.timing_rounds, args.lr, ex, args.max_length)
                cfg["eval"] = {"every": args.timing_rounds}
                res = run(cfg, None)  # the engine's seconds per round: training rounds only
                rounds = [h["seconds"]["round"] for h in res.history]
                seconds[ex].append(sum(rounds) / len(rounds))
        best = {ex: min(v) for ex, v in seconds.items()}
        results["seconds_per_round"] = best | {"speedup": best["sequential"] / best["vectorized"]}
        print(
            f"seconds per round (share a, best of repeats): sequential {best['sequential']:.2f}, "
            f"vectorized {best['vectorized']:.2f}, "
            f"speedup {results['seconds_per_round']['speedup']:.2f}x"
        )
    if not args.skip_central:
        log("[peft] central LoRA ...")
        cfg = config(args.model, "both", 1, args.lr, "sequential", args.max_length)
        cfg["algorithm"] = {"name": "centralized"}
        res = run(cfg, None)
        acc = res.summary["final"]["global"]["accuracy"]
        results["central_lora_1_epoch"] = acc
        print(f"central LoRA, 1 epoch: accuracy {acc:.3f} (pooled test data)")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
