"""Incentives and contribution evaluation (issue #19, docs/incentives.md): the numbers of the
issue's closing note.

1. FLI dynamics (Yu et al. 2020's queues, simulated): 10 owners, c ~ U[0.5, 2], q ~ U[0, 1],
   T = 100, R = 1, at B = 1.5, 0.5 and 0.8 x sum c: the regret queues of FLI and the
   baselines, and the omega sweep at B = 1.5 sum c.
2. GTG vs exact on FL rounds with 8 clients (Fashion-MNIST, 2NN MLP, FedAvg): each round's
   coalition values computed exactly (all 2^8), GTG replayed on the same table: coalitions it
   evaluates and its relative L1 error.
3. Fashion-MNIST, 5 clients, one with random labels, 5 rounds, GTG: the random-label client's
   rank by cumulative value over seeds, and the spread between two clients holding identical
   data.
4. Seconds that contribution evaluation adds per round (each estimator, same setting as 3).

Usage: ``FEDLOOM_DATA=../shared/data python benchmarks/incentives.py [--seeds 10]``
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import fedloom
from fedloom.attacks.selection import malicious_clients
from fedloom.config import parse_config
from fedloom.data.federated import FederatedData, from_arrays
from fedloom.data.mnist import load_mnist_arrays
from fedloom.engine.callbacks import Callback
from fedloom.engine.loop import Engine
from fedloom.incentives.book import IncentiveBook
from fedloom.incentives.fairness import spearman
from fedloom.incentives.shapley import exact_shapley, gtg_shapley
from fedloom.models import build_model

SCHEMES = ["fli", "equal", "samples", "shapley", "cost"]


# -- 1. FLI dynamics --------------------------------------------------------------------------
def fli_dynamics(fraction: float, omega: float, rounds: int = 100) -> dict[str, Any]:
    """Item 1's simulation (NumPy seed 0): var_i Y_i(T) per scheme, the growth of sum Y
    in the last round (in units of sum c) and Spearman(pay - cost, q) for FLI."""
    rng = np.random.default_rng(0)
    c, q = rng.uniform(0.5, 2.0, 10), rng.uniform(0.0, 1.0, 10)
    n = rng.integers(100, 1000, 10)
    book = IncentiveBook(SCHEMES, fraction * c.sum(), omega, 1)
    totals = []
    for t in range(1, rounds + 1):
        book.pay(t, dict(enumerate(c)), dict(enumerate(q)), dict(enumerate(n)))
        totals.append(sum(book.ledgers["fli"].regret.values()))
    net = [book.ledgers["fli"].paid[i] - book.cost[i] for i in range(10)]
    return {
        "var_regret": {s: float(np.var(list(book.ledgers[s].regret.values()))) for s in SCHEMES},
        "regret_growth": float((totals[-1] - totals[-2]) / c.sum()),
        "spearman_net_pay_contribution": spearman(net, list(q)),
    }


# -- FL scenarios --------------------------------------------------------------------------
def fmnist_clients(
    root: str | Path, seed: int, clients: int, per_client: int, identical: tuple[int, int] | None
) -> FederatedData:
    """``clients`` disjoint shards of the official Fashion-MNIST training images
    (``per_client`` each, drawn with ``seed``), test sets from the official test images; the
    pair ``identical`` holds the same shard."""
    x, y, xt, yt = load_mnist_arrays(root, "fashion_mnist")
    rng = np.random.default_rng(seed)
    order, test_order = rng.permutation(len(x)), rng.permutation(len(xt))
    shard = [order[k * per_client : (k + 1) * per_client] for k in range(clients)]
    if identical is not None:
        shard[identical[1]] = shard[identical[0]]
    test_n = per_client // 4

    def images(a: np.ndarray) -> np.ndarray:
        return (a.astype(np.float32) / 255.0)[:, None]

    train = [(images(x[s]), y[s].astype(np.int64)) for s in shard]
    test = [
        (
            images(xt[test_order[k * test_n : (k + 1) * test_n]]),
            yt[test_order[k * test_n : (k + 1) * test_n]].astype(np.int64),
        )
        for k in range(clients)
    ]
    return from_arrays(train, test, name="fashion_mnist")


def fl_config(seed: int, rounds: int, contribution: dict[str, Any]) -> dict[str, Any]:
    return {
        "seed": seed,
        "model": {"name": "mlp"},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": rounds, "local_steps": 20, "batch_size": 32, "lr": 0.05},
        "eval": {"every": rounds},
        "monitor": {"enabled": False},
        "executor": {"kind": "sequential"},
        "checkpoint": {"every": None},
        "contribution": {"validation_fraction": 0.2, **contribution},
    }


# -- 2. GTG vs exact -----------------------------------------------------------------------
class _Tables(Callback):
    """Every valued round's coalition values (the exact estimator evaluates all of them)."""

    def __init__(self) -> None:
        self.tables: list[dict[tuple[int, ...], float]] = []
        self.incentives: Any = None
        """The run's contribution callback (engine/contribution.py), set once it is built."""

    def on_round_end(self, ctx: Any, state: Any, report: Any) -> dict[str, Any]:
        self.tables.append(dict(self.incentives.game.values))
        return {}


def round_tables(
    root: str | Path, seed: int = 0, rounds: int = 5, clients: int = 8, per_client: int = 600
) -> list[dict[tuple[int, ...], float]]:
    """Each round's complete coalition table of an FL run with ``clients`` clients a round."""
    data = fmnist_clients(root, seed, clients, per_client, None)
    cfg = parse_config(fl_config(seed, rounds, {"kind": "exact"}))
    grab = _Tables()
    module = build_model("mlp", data.input_shape, data.num_outputs)
    engine = Engine(cfg, data, module, callbacks=[grab])
    grab.incentives = engine.mechanisms.named("incentives")
    engine.run()
    return grab.tables


def gtg_against_exact(
    table: dict[tuple[int, ...], float], seed: int, tolerance: float = 1e-3
) -> dict[str, Any]:
    """GTG replayed on a round's table (within-round truncation at ``tolerance``, round
    truncation at 1e-3): coalitions evaluated (of 2^n), permutations, and the relative L1
    error of its raw and rescaled values against the exact ones."""
    players = sorted(max(table, key=len))
    exact = exact_shapley(table.__getitem__, players).raw
    gtg = gtg_shapley(table.__getitem__, players, np.random.default_rng(seed), tolerance=tolerance)
    scale = sum(abs(v) for v in exact.values())

    def error(values: dict[int, float]) -> float:
        return sum(abs(values[i] - exact[i]) for i in players) / scale if scale else 0.0

    return {
        "evaluations": gtg.evaluations,
        "share": gtg.evaluations / 2 ** len(players),
        "permutations": gtg.permutations,
        "truncated": gtg.truncated,
        "l1_raw": error(gtg.raw),
        "l1_rescaled": error(gtg.reported),
        "gain": gtg.gain,
    }


# -- 3. random labels -------------------------------------------------------------------------
def random_label_run(
    root: str | Path,
    seed: int,
    rounds: int = 5,
    kind: str = "gtg",
    per_client: int = 1000,
    metric: str = "loss",
    train: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """5 clients, one poisoned with random labels (``attack: random_labels``: its validation
    part was held out before), two others holding identical data: the poisoned client's rank
    by cumulative value (1 = lowest) and the relative gap between the identical pair."""
    bad = malicious_clients(seed, list(range(5)), 0.2)[0]
    pair = tuple(c for c in range(5) if c != bad)[:2]
    data = fmnist_clients(root, seed, 5, per_client, pair)  # type: ignore[arg-type]
    config = fl_config(seed, rounds, {"kind": kind, "metric": metric})
    config["train"].update(train or {})
    config["attack"] = {"kind": "random_labels", "fraction": 0.2}
    result = fedloom.run(config, data=data, write=False, progress=False)
    values = {int(c): v for c, v in result.summary["contribution"]["per_client"].items()}
    order = sorted(values, key=values.get)  # type: ignore[arg-type]
    a, b = (values[c] for c in pair)
    return {
        "seed": seed,
        "random_label_client": bad,
        "rank_from_bottom": order.index(bad) + 1,
        "values": values,
        "identical_pair": list(pair),
        "identical_gap": abs(a - b) / max(abs(a), abs(b)),
        "seconds_per_round": result.summary["contribution"]["seconds_per_round"],
        "round_seconds": result.summary["seconds_per_round"],
        "evaluations_per_round": result.summary["contribution"]["evaluations_per_round"],
        "accuracy": result.summary["final"]["global"]["accuracy"],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--root", default=os.environ.get("FEDLOOM_DATA", "../shared/data"))
    parser.add_argument("--only", default="dynamics,gtg,labels_gtg,labels_exact,seconds")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    only = set(args.only.split(","))
    out: dict[str, Any] = {}
    if "dynamics" in only:
        out["dynamics"] = {f"B={f} sum c": fli_dynamics(f, 1.0) for f in (1.5, 0.5, 0.8)} | {
            f"omega={w} (B=1.5 sum c)": fli_dynamics(1.5, w) for w in (1.0, 10.0, 100.0)
        }
        print("\nFLI dynamics: var_i Y_i(T) per scheme")
        print("| setting | " + " | ".join(SCHEMES) + " | sum Y growth / sum c | Spearman |")
        print("| --- |" + " --- |" * (len(SCHEMES) + 2))
        for name, row in out["dynamics"].items():
            cells = [f"{row['var_regret'][s]:.2f}" for s in SCHEMES]
            print(
                f"| {name} | "
                + " | ".join(cells)
                + f" | {row['regret_growth']:.3f} | {row['spearman_net_pay_contribution']:.3f} |"
            )
    if "gtg" in only:
        tick = time.perf_counter()
        tables = round_tables(args.root, rounds=args.rounds)
        seconds = time.perf_counter() - tick
        out["gtg_vs_exact"] = {"seconds": seconds}
        for eps in (1e-3, 3e-3, 1e-2):
            rows = [gtg_against_exact(t, r, eps) for r, t in enumerate(tables, 1)]
            out["gtg_vs_exact"][str(eps)] = rows
            print(f"\nGTG vs exact, 8 clients (2^8 = 256 coalitions), epsilon {eps:g}")
            print("| round | gain | evaluations | share | permutations | L1 raw | L1 rescaled |")
            print("| --- | --- | --- | --- | --- | --- | --- |")
            for r, row in enumerate(rows, 1):
                print(
                    f"| {r} | {row['gain']:.4f} | {row['evaluations']} | {row['share']:.2f} | "
                    f"{row['permutations']} | {row['l1_raw']:.3f} | {row['l1_rescaled']:.3f} |"
                )
    for kind in ("gtg", "exact"):
        if f"labels_{kind}" not in only and not (kind == "gtg" and "labels" in only):
            continue
        runs = [random_label_run(args.root, s, args.rounds, kind) for s in range(args.seeds)]
        last = sum(r["rank_from_bottom"] == 1 for r in runs)
        gaps = [r["identical_gap"] for r in runs]
        out[f"random_labels_{kind}"] = {"runs": runs, "ranked_last": last, "seeds": len(runs)}
        print(
            f"\n{kind}: random-label client ranked last in {last}/{len(runs)} seeds; gap "
            f"between the identical pair: mean {np.mean(gaps):.3f}, max {max(gaps):.3f}"
        )
        for r in runs:
            print(
                f"seed {r['seed']}: rank {r['rank_from_bottom']}, identical pair gap "
                f"{r['identical_gap']:.3f}, accuracy {r['accuracy']:.3f}"
            )
    if "seconds" in only:
        out["seconds"] = {}
        print(
            "\nSeconds contribution evaluation adds per round (5 clients, 1,000 validation samples)"
        )
        for kind in ("loo", "exact", "tmc", "gtg"):
            run = random_label_run(args.root, 0, args.rounds, kind)
            out["seconds"][kind] = {
                k: run[k] for k in ("seconds_per_round", "evaluations_per_round", "round_seconds")
            }
            print(
                f"{kind}: {run['seconds_per_round']:.3f} s/round, "
                f"{run['evaluations_per_round']:.1f} coalitions/round "
                f"(the whole round, evaluation included: {run['round_seconds']:.3f} s)"
            )
    print(json.dumps(out, default=str))
    return out


if __name__ == "__main__":
    main()
