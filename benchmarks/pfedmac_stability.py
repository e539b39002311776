"""pFedMac's stable range on the shared PFL setup (Fashion-MNIST, 2 label shards per client,
20 clients, the 2NN, 10 clients a round): personalized accuracy (mean and worst client) and the
global model's norm per evaluation, for a grid of lam / lr / local work.

    python benchmarks/pfedmac_stability.py --lam 0.1 0.01 --local-epochs 1 --rounds 20

The growth the module docstring of fedloom/algorithms/pfedmac.py predicts per round,
g = lr * inner_lr * inner_steps * lam^2 * R^2 / 2 (R local steps), is printed beside each run.
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from typing import Any

import torch

import fedloom

BASE: dict[str, Any] = {
    "seed": 0,
    "data": {
        "name": "fashion_mnist",
        "num_clients": 20,
        "partition": {"kind": "shards", "shards_per_client": 2},
    },
    "model": {"name": "mlp"},
    "train": {"clients_per_round": 10, "batch_size": 32},
    "monitor": {"enabled": False},
    "checkpoint": {"every": None},
}


def one(lam: float, lr: float, local: dict[str, int], rounds: int, every: int) -> None:
    config = copy.deepcopy(BASE)
    config["algorithm"] = {"name": "pfedmac", "lam": lam}
    config["train"].update({"rounds": rounds, "lr": lr, **local, "nonfinite": "drop"})
    config["eval"] = {"every": every}
    tick = time.perf_counter()
    result = fedloom.run(config, write=False, progress=False)
    steps = local.get("local_steps") or local["local_epochs"] * math.ceil(2400 / 32)
    growth = lr * lr * 5 * lam**2 * steps**2 / 2
    print(f"lam={lam} lr={lr} {local} (R={steps}, predicted growth {growth:.3g}/round)")
    for row in result.history:
        pers = row.get("personalized") or {}
        acc = row.get("client_accuracy") or []
        low = min(acc) if acc else float("nan")
        print(
            f"  round {row['round']:3d}: personalized mean"
            f" {pers.get('accuracy_mean', float('nan')):.3f}"
            f" min {low:.3f} dropped {row.get('dropped_nonfinite', 0)}"
        )
    norm = math.sqrt(sum(float(v.double().pow(2).sum()) for v in result.global_params.values()))
    finite = all(bool(torch.isfinite(v).all()) for v in result.global_params.values())
    print(f"  global norm {norm:.4g} (finite: {finite}), {time.perf_counter() - tick:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lam", type=float, nargs="+", default=[0.1, 0.01])
    parser.add_argument("--lr", type=float, nargs="+", default=[0.05])
    parser.add_argument("--local-epochs", type=int, nargs="*", default=[1])
    parser.add_argument("--local-steps", type=int, nargs="*", default=[])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--every", type=int, default=4)
    args = parser.parse_args()
    works = [{"local_epochs": e} for e in args.local_epochs]
    works += [{"local_steps": s} for s in args.local_steps]
    for lam in args.lam:
        for lr in args.lr:
            for work in works:
                one(lam, lr, work, args.rounds, args.every)


if __name__ == "__main__":
    main()
