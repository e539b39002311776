"""A/B check of a refactoring: every result of one tree against another's, bit for bit.

``record OUT.pt`` runs, in the tree it is started from (``PYTHONPATH=src``):
- every registered algorithm on the executor-equivalence config of
  tests/engine/test_executor_equivalence.py (digits, 8 clients, 3 rounds, stragglers, a new
  client), sequentially and vectorized in chunks of 3;
- example configs of every run family, cut to a few rounds: MNIST FedAvg, digits
  FedAvg + fine-tuning, compression, contribution and incentives, client-level DP, federated RL
  (REINFORCE PAvg, vertical DQN) and SecureBoost;
and saves each run's history (wall-clock keys dropped), summary (the same) and every model
tensor. ``compare A.pt B.pt`` lists every difference (exact: ``torch.equal``, ``==``) and
exits 1 if there is one.

    PYTHONPATH=src python benchmarks/ab_results.py record /tmp/new.pt
    python benchmarks/ab_results.py compare /tmp/old.pt /tmp/new.pt
"""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

import torch

TIMING = {"wall_seconds", "seconds_per_round", "seconds", "round_seconds", "time", "elapsed"}


def equivalence_config(algorithm: str, executor: dict[str, Any]) -> dict[str, Any]:
    """tests/engine/test_executor_equivalence.py's config (its hyperparameters included)."""
    sys.path.insert(0, ".")
    from tests.engine.test_executor_equivalence import config

    model = "cnn_bn" if algorithm == "fedbn" else "mlp"
    return config(algorithm, model, executor, 16)


EXAMPLES: dict[str, tuple[str, list[str]]] = {
    "mnist": ("examples/mnist.yaml", ["train.rounds=3", "eval.every=1"]),
    "digits_ft": ("examples/digits.yaml", ["train.rounds=6", "eval.every=2"]),
    "compression": ("examples/compression_mnist.yaml", ["train.rounds=2", "eval.every=1"]),
    "incentives": (
        "examples/incentives_fashion_mnist.yaml",
        ["train.rounds=2", "eval.every=1", "train.local_steps=5"],
    ),
    "frl": ("examples/frl_cartpole.yaml", ["train.rounds=4"]),
    "vfrl": ("examples/vfrl_cartpole.yaml", ["train.rounds=4"]),
}

INLINE: dict[str, dict[str, Any]] = {
    "client_dp": {
        "seed": 3,
        "data": {"name": "digits", "num_clients": 10, "partition": {"kind": "iid"}},
        "model": {"name": "logreg"},
        "algorithm": {"name": "fedavg"},
        "train": {"rounds": 3, "clients_per_round": 5, "local_steps": 3, "lr": 0.05},
        "privacy": {"kind": "client_dp", "noise_multiplier": 1.0, "clip": 1.0},
        "eval": {"every": 1},
    },
    "secureboost": {
        "seed": 0,
        "data": {
            "name": "breast_cancer",
            "partition": {"kind": "vertical", "parties": [[0, 10], [10, 30]]},
            "test_fraction": 0.3,
        },
        "algorithm": {"name": "secureboost", "n_trees": 3, "max_depth": 3},
        "secure_aggregation": {"kind": "none"},
        "eval": {"every": 1},
    },
}


def is_timing(key: object) -> bool:
    """Whether a summary or metrics key holds wall-clock time."""
    return key in TIMING or str(key).startswith("seconds") or str(key).endswith("per_second")


def strip(value: Any) -> Any:
    """``value`` without wall-clock keys, tensors as tensors."""
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if not is_timing(k)}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def outcome(result: Any) -> dict[str, Any]:
    return {
        "history": strip(result.history),
        "summary": strip(result.summary),
        "global": result.global_params,
        "clients": result.client_params,
    }


def record(out: str, only: str | None) -> None:
    import fedloom
    from fedloom.algorithms import ALGORITHMS
    from fedloom.config import load_yaml

    runs: dict[str, Any] = {}
    jobs: list[tuple[str, Any]] = []
    for name in ALGORITHMS.names():
        for label, executor in (
            ("sequential", {"kind": "sequential"}),
            ("vectorized", {"kind": "vectorized", "chunk_size": 3}),
        ):
            jobs.append((f"{name}/{label}", equivalence_config(name, executor)))
    for name, (path, sets) in EXAMPLES.items():
        cfg = load_yaml(path)
        for assignment in sets:
            key, value = assignment.split("=")
            node = cfg
            *parents, leaf = key.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = int(value)
        jobs.append((f"example/{name}", cfg))
    jobs += [(f"example/{name}", cfg) for name, cfg in INLINE.items()]
    for label, cfg in jobs:
        if only and only not in label:
            continue
        start = time.perf_counter()
        try:
            runs[label] = outcome(fedloom.run(cfg, write=False, progress=False))
        except Exception as err:  # recorded: a refusal must stay a refusal
            runs[label] = {"error": f"{type(err).__name__}: {err}"}
        print(f"{label}: {time.perf_counter() - start:.1f} s", flush=True)
    torch.save(runs, out)


def differences(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
        if same:
            return []
        gap = (a.double() - b.double()).abs().max().item() if _comparable(a, b) else "shape"
        return [f"{where}: tensors differ ({gap})"]
    if isinstance(a, dict) and isinstance(b, dict):
        out = (
            [f"{where}: keys {sorted(map(str, a.keys() ^ b.keys()))}"]
            if a.keys() != b.keys()
            else []
        )
        for key in a.keys() & b.keys():
            out += differences(a[key], b[key], f"{where}.{key}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return [f"{where}: {len(a)} vs {len(b)} items"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, f"{where}[{i}]")
        ]
    if a != b and not (isinstance(a, float) and isinstance(b, float) and a != a and b != b):
        return [f"{where}: {a!r} vs {b!r}"]
    return []


def _comparable(a: torch.Tensor, b: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape


def compare(old: str, new: str) -> int:
    # stripped again: a recording made with a shorter list of wall-clock keys compares too
    a = strip(torch.load(old, weights_only=False))
    b = strip(torch.load(new, weights_only=False))
    found = differences(a, b, "runs")
    for line in found[:200]:
        print(line)
    print(f"{len(a)} runs recorded in A, {len(b)} in B; {len(found)} differences")
    return 1 if found else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("out")
    rec.add_argument("--only", default=None, help="record only the runs whose label has this")
    cmp = sub.add_parser("compare")
    cmp.add_argument("old")
    cmp.add_argument("new")
    args = parser.parse_args()
    if args.command == "record":
        record(args.out, args.only)
        return 0
    return compare(args.old, args.new)


if __name__ == "__main__":
    sys.exit(main())
