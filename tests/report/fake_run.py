"""Fake but realistic run directories (config, metrics, summary, label histogram)."""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

CONFIG: dict[str, Any] = {
    "seed": 0,
    "data": {
        "name": "mnist",
        "num_clients": 20,
        "partition": {"kind": "dirichlet", "alpha": 0.3},
        "test_fraction": 0.2,
    },
    "model": {"name": "mlp", "hidden": [200, 200]},
    "algorithm": {"name": "fedavg", "local_epochs": 1, "finetune_steps": 5},
    "train": {"rounds": 50, "batch_size": 32, "lr": 0.05, "eval_every": 5},
    "executor": {"kind": "sequential"},
}
COLD_START: dict[str, Any] = {
    "clients": 4,
    "lr": 0.05,
    "steps": [0, 1, 5, 20],
    "loss_mean": [2.1, 1.4, 0.9, 0.6],
    "accuracy_mean": [0.31, 0.52, 0.71, 0.83],
    "accuracy_p10": [0.12, 0.35, 0.58, 0.74],
    "accuracy_p50": [0.30, 0.53, 0.72, 0.84],
    "accuracy_p90": [0.48, 0.69, 0.85, 0.93],
    "accuracy_min": [0.08, 0.31, 0.55, 0.71],
}
"""summary.json's ``cold_start`` of a run with held-out new clients."""
MakeRun = Callable[..., Path]  # the make_run fixture
BYTES_PER_ROUND = 10 * 178_110 * 4


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def make_rows(
    n_rounds: int = 10,
    *,
    num_clients: int = 20,
    global_model: bool = True,
    regression: bool = False,
    client_accuracy: bool = True,
    new_clients: bool = False,
    every: int = 5,
    monitor: bool = True,
) -> list[dict[str, Any]]:
    """Metrics rows as the engine writes them, for rounds every, 2*every, ..."""
    rng = random.Random(0)
    skill = [rng.uniform(-0.12, 0.08) for _ in range(num_clients)]
    rows = []
    for i in range(1, n_rounds + 1):
        rnd = i * every
        level = 0.95 - 0.6 * math.exp(-rnd / 12)
        accs = [min(0.999, max(0.0, level + s + rng.gauss(0, 0.01))) for s in skill]
        loss = 2.3 * math.exp(-rnd / 10) + 0.15
        personalized: dict[str, Any] = {
            "accuracy_mean": sum(accs) / len(accs),
            "accuracy_p10": _quantile(accs, 0.1),
            "accuracy_p50": _quantile(accs, 0.5),
            "accuracy_p90": _quantile(accs, 0.9),
            "accuracy_min": min(accs),
            "loss_mean": loss * 1.05,
        }
        if regression:
            personalized = {
                k: (None if k.startswith("accuracy") else v) for k, v in personalized.items()
            }
        row: dict[str, Any] = {
            "round": rnd,
            "wall_seconds": 1.23 * rnd,
            "train_loss": loss * 0.9,
            "participants": 10,
            "global": (
                {"accuracy": None if regression else level - 0.03, "loss": loss}
                if global_model
                else None
            ),
            "personalized": personalized,
            "communication": {
                "bytes_up": BYTES_PER_ROUND * rnd,
                "bytes_down": BYTES_PER_ROUND * rnd,
            },
        }
        if monitor:
            norms = [0.5 * math.exp(-rnd / 40) * (1 + 0.3 * s) for s in skill[:8]]
            row["monitor"] = {
                "update_norm": {
                    "min": min(norms),
                    "p10": _quantile(norms, 0.1),
                    "p50": _quantile(norms, 0.5),
                    "p90": _quantile(norms, 0.9),
                    "max": max(norms),
                    "mean": sum(norms) / len(norms),
                },
                "client_update_norm": {str(c): n for c, n in enumerate(norms)},
                "cosine": {
                    "clients": list(range(8)),
                    "matrix": [
                        [1.0 if i == j else 0.6 - 0.15 * abs(i - j) for j in range(8)]
                        for i in range(8)
                    ],
                },
                "zeta2": 3.0 * math.exp(-rnd / 25) + 0.4,
            }
            row["seconds"] = {"round": 1.2 + rng.uniform(0, 0.1), "monitor": 0.05}
            row["communication"] |= {
                "bytes_up_round": BYTES_PER_ROUND,
                "bytes_down_round": BYTES_PER_ROUND,
            }
        if new_clients:
            row["new_clients"] = {k: v and v * 0.97 for k, v in personalized.items()}
        if client_accuracy:
            row["client_accuracy"] = [None if regression else a for a in accs]
        rows.append(row)
    return rows


def make_run_dir(
    path: Path,
    rows: list[dict[str, Any]],
    *,
    summary: bool = True,
    label_histogram: bool = True,
    config: dict[str, Any] | None = None,
    test_samples: dict[str, int] | None = None,
) -> Path:
    """Write config.yaml, metrics.jsonl and optionally summary.json / label_histogram.json."""
    path.mkdir(parents=True, exist_ok=True)
    config = CONFIG if config is None else config
    (path / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
    (path / "metrics.jsonl").write_text(
        "".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8"
    )
    if summary and rows:
        last = rows[-1]
        final = {"global": last["global"], "personalized": last["personalized"]}
        (path / "summary.json").write_text(
            json.dumps(
                {
                    "algorithm": config["algorithm"]["name"],
                    "dataset": config["data"]["name"],
                    "model": config["model"]["name"],
                    "num_clients": config["data"]["num_clients"],
                    "rounds": config["train"]["rounds"],
                    "seed": config["seed"],
                    "executor": config["executor"]["kind"],
                    "final": final,
                    "communication": last["communication"],
                    "wall_seconds": last["wall_seconds"],
                    "seconds_per_round": last["wall_seconds"] / last["round"],
                    **({"cold_start": COLD_START} if "new_clients" in last else {}),
                }
            ),
            encoding="utf-8",
        )
    if label_histogram and rows and "monitor" in rows[0]:
        n = config["data"]["num_clients"]
        heterogeneity = {
            "label_kl": {str(c): 0.2 + 0.05 * (c % 7) for c in range(n)},
            "feature_js": {str(c): 0.001 + 0.0004 * (c % 5) for c in range(n)},
            "test_samples": test_samples or {str(c): 60 for c in range(n)},
        }
        (path / "heterogeneity.json").write_text(json.dumps(heterogeneity), encoding="utf-8")
    if label_histogram:
        rng = random.Random(1)
        n = config["data"]["num_clients"]
        counts = []
        for _ in range(n):
            weights = [rng.gammavariate(0.3, 1.0) for _ in range(10)]
            total = sum(weights)
            counts.append([round(2400 * w / total) for w in weights])
        (path / "label_histogram.json").write_text(
            json.dumps({"client_names": [f"client_{i:02d}" for i in range(n)], "counts": counts}),
            encoding="utf-8",
        )
    return path
