"""Membership inference on Fashion-MNIST and the three defences of docs/audit.md (issue #15;
Yeom et al. 2018, Shokri et al. 2017).

The setting (docs/audit.md, "Measured"): IID clients of 200 training samples (and 100 held
out) from the official training split, the 2NN (784-200-200-10), SGD lr 0.05, batch 32, one
local epoch a round; the official test split is the never-seen holdout. Runs, per seed:

- local training, 100 rounds (100 epochs): the overfit reference;
- FedAvg, 30 rounds, all clients;
- Ditto with lambda (``mu``) 0.1 and 1, 30 rounds, FedAvg as its global algorithm.

Each run directory is audited by ``fedloom.audit`` (loss-threshold and shadow-model attacks,
200 members and 200 label-matched non-members per target). Table 1: the AUC of each target
(mean +- sd over seeds), TPR at 1% FPR, the label-only advantage, the deployed models'
accuracy. Table 2: the defence trade-off (audit/study.py) around the FedAvg run: personal
models from its global model (Ditto's objective, mu 0.1, 50 epochs), each defence's AUC and
accuracy, means over clients and seeds. The last line is all of it as JSON.

Usage: ``FEDLOOM_DATA=../shared/data python benchmarks/mia_defences.py [--seeds 0,1,2]
[--clients 20] [--study-clients 10] [--no-shadow]``
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import fedloom
from fedloom.audit.scenarios import small_clients
from fedloom.audit.study import StudySetup
from fedloom.data.load import default_root

RUNS = {
    "local overfit": ({"name": "local"}, 100),
    "FedAvg": ({"name": "fedavg"}, 30),
    "Ditto lambda=0.1": ({"name": "ditto", "mu": 0.1}, 30),
    "Ditto lambda=1": ({"name": "ditto", "mu": 1.0}, 30),
}


def config(seed: int, algorithm: dict[str, Any], rounds: int) -> dict[str, Any]:
    return {
        "seed": seed,
        "model": {"name": "mlp"},
        "algorithm": algorithm,
        "train": {"rounds": rounds, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "eval": {"every": rounds},
        "checkpoint": {"every": rounds},
        "monitor": {"enabled": False},
        "executor": {"kind": "sequential"},
    }


def mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.fmean(values):.3f} ± {sd:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--study-clients", type=int, default=10)
    parser.add_argument("--no-shadow", action="store_true")
    args = parser.parse_args()
    warnings.simplefilter("ignore", UserWarning)
    seeds = [int(s) for s in args.seeds.split(",")]
    attacks = ["loss"] if args.no_shadow else ["loss", "shadow"]
    study = StudySetup(
        mu=0.1,
        epochs=50,
        members=200,
        clients=args.study_clients,
        prox_sigmas=(0.3, 1.0, 3.0),
        prox_draws=("step", "once"),
    )
    table: dict[tuple[str, str], dict[str, list[float]]] = {}
    defence_rows: dict[tuple[str, str], list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="fedloom-mia-") as tmp:
        for seed in seeds:
            data, holdout = small_clients(default_root(), args.clients, 200, 100, seed)
            for name, (algorithm, rounds) in RUNS.items():
                tick = time.perf_counter()
                out = Path(tmp) / f"{name.replace(' ', '_')}-{seed}"
                result = fedloom.run(config(seed, algorithm, rounds), data=data, out=out)
                final = result.summary["final"]
                accuracy = {
                    "deployed": final["personalized"]["accuracy_mean"],
                    "global": (final["global"] or {}).get("accuracy"),
                }
                for attack in attacks:
                    defences = attack == "loss" and name == "FedAvg"
                    doc = fedloom.audit(
                        out, attack, data=data, holdout=holdout, members=200,
                        defences=defences, study=study,
                    )  # fmt: skip
                    res = doc["attacks"][attack]
                    targets = {"deployed": res["client_mean"]}
                    if res["global"] is not None:
                        targets["global"] = res["global"]
                    for target, r in targets.items():
                        cell = table.setdefault((name, target), {})
                        cell.setdefault(f"{attack}_auc", []).append(r["auc"])
                        cell.setdefault(f"{attack}_tpr", []).append(r["tpr_at_1pct_fpr"])
                        if attack == "loss":
                            cell.setdefault("accuracy", []).append(accuracy[target])
                            if target == "deployed":
                                lo = [c["label_only"]["advantage"] for c in res["clients"].values()]
                            else:
                                lo = [r["label_only"]["advantage"]]
                            cell.setdefault("label_only", []).append(statistics.fmean(lo))
                    if defences:
                        for row in doc["defences"]["rows"]:
                            key = (row["defence"], row["setting"])
                            defence_rows.setdefault(key, []).append(row)
                print(f"seed {seed} {name}: {time.perf_counter() - tick:.1f} s", file=sys.stderr)

    print(f"\nTable 1: membership inference, {args.clients} clients, seeds {args.seeds}")
    head = "| run | target | loss AUC | TPR@1%FPR | label-only adv. |"
    head += " shadow AUC |" if not args.no_shadow else ""
    print(head + " accuracy |")
    print("|" + " --- |" * (head.count("|") - 1 + 1))
    out_rows = []
    for (name, target), cell in table.items():
        line = (
            f"| {name} | {target} | {mean_sd(cell['loss_auc'])} | "
            f"{statistics.fmean(cell['loss_tpr']):.3f} | "
            f"{statistics.fmean(cell['label_only']):.3f} |"
        )
        if not args.no_shadow:
            line += f" {mean_sd(cell['shadow_auc'])} |"
        print(line + f" {statistics.fmean(cell['accuracy']):.3f} |")
        out_rows.append({"run": name, "target": target, **cell})

    print(f"\nTable 2: defence trade-off around FedAvg's global model (means over "
          f"{args.study_clients} clients and {len(seeds)} seeds)")  # fmt: skip
    print("| defence | setting | guarantee | AUC | Δ AUC | TPR@1%FPR | accuracy | accuracy cost |")
    print("|" + " --- |" * 8)
    study_rows = []
    for (defence, setting), rows in defence_rows.items():
        ok = [r for r in rows if r["auc"] is not None]  # a seed whose every client diverged
        mean = {
            k: statistics.fmean(r[k] for r in ok) if ok else float("nan")
            for k in ("auc", "auc_change", "tpr_at_1pct_fpr", "accuracy", "accuracy_cost")
        }
        diverged = sum(r["diverged"] for r in rows)
        guarantee = rows[0]["guarantee"] + (f"; {diverged} diverged" if diverged else "")
        print(
            f"| {defence} | {setting} | {guarantee} | {mean['auc']:.3f} | "
            f"{mean['auc_change']:+.3f} | {mean['tpr_at_1pct_fpr']:.3f} | "
            f"{mean['accuracy']:.3f} | {mean['accuracy_cost']:+.3f} |"
        )
        per_seed = [None if r["auc"] is None else round(r["auc_change"], 4) for r in rows]
        study_rows.append(
            {"defence": defence, "setting": setting, "guarantee": guarantee, **mean,
             "auc_change_per_seed": per_seed}
        )  # fmt: skip
    print(json.dumps({"mia": out_rows, "defences": study_rows}))


if __name__ == "__main__":
    main()
