"""Reproduce the Synthetic experiments of FedProx (Li et al., "Federated Optimization in
Heterogeneous Networks", MLSys 2020, arXiv:1812.06127): Section 5.2, Figure 1 and the
appendix figures 2, 5, 6 and 7.

Every (dataset, straggler fraction, method) cell is one ``fedloom.run`` with its own run
directory (and report.html) under ``OUT/runs/``. The script then writes ``OUT/table.md``,
``OUT/table.csv``, ``OUT/results.json`` and ``OUT/curves.html`` (and PNGs when kaleido is
installed). See benchmarks/reproduce/README.md.

Usage::

    python benchmarks/reproduce/fedprox_synthetic.py                 # the full grid, 200 rounds
    python benchmarks/reproduce/fedprox_synthetic.py --rounds 20 --datasets 1_1 --stragglers 0.9
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import platform
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

import fedloom
from fedloom.config import parse_config
from fedloom.core.functional import FunctionalModel
from fedloom.data import FederatedData, load_dataset
from fedloom.engine.rundir import RunDir
from fedloom.models import build_model

REPO = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO / "benchmarks" / "reproduce" / "results" / "fedprox_synthetic"
SCRIPT = "benchmarks/reproduce/fedprox_synthetic.py"

# The paper's setup (Section 5.1, Appendix C.2; the released run_fedprox.sh agrees).
DEVICES_PER_ROUND = 10
LOCAL_EPOCHS = 20
BATCH_SIZE = 10
LR = 0.01
DEFAULT_MU = 1.0
"""The paper's best mu for Synthetic (Section 5.3.2: 'the best mu values are 1, ...')."""
DEFAULT_TEST_FRACTION = 0.1
"""The released generate_synthetic.py keeps int(0.9 n) samples of each device for training;
Appendix C.2 says 80/20. The released data is what the figures were made from."""

PAPER_DIVERGE_GAP = 1.0
"""Appendix C.3.2: a method diverges when f_t - f_{t-10} > 1 (f: global training loss)."""
PAPER_DIVERGE_LAG = 10
PAPER_CONVERGE_TOL = 1e-4
"""Appendix C.3.2: a method has converged when |f_t - f_{t-1}| < 0.0001."""
SIMILAR_REL = 0.10
"""Figure 5's 'little effect' on IID data, made checkable: tail losses within 10%."""
IDENTICAL_TOL = 1e-6

STRAGGLER_NOTE = (
    "Stragglers: each round floor(fraction x 10) of the 10 selected devices straggle. fedloom "
    "draws a straggler's work per local step (uniform in 1..S of its S = 20 x ceil(n_k/10) "
    "steps); the paper draws whole epochs (uniform in [1, E], E = 20; the released code draws "
    "1..E-1). FedAvg drops stragglers (straggler_mode: drop), FedProx keeps their partial work "
    "(straggler_mode: partial)."
)


@dataclass(frozen=True)
class Dataset:
    key: str
    label: str
    alpha: float
    beta: float
    iid: bool


DATASETS: dict[str, Dataset] = {
    d.key: d
    for d in (
        Dataset("iid", "Synthetic-IID", 0.0, 0.0, True),
        Dataset("0_0", "Synthetic(0,0)", 0.0, 0.0, False),
        Dataset("0.5_0.5", "Synthetic(0.5,0.5)", 0.5, 0.5, False),
        Dataset("1_1", "Synthetic(1,1)", 1.0, 1.0, False),
    )
}
"""Statistical heterogeneity increases from left to right (Figure 2)."""


@dataclass(frozen=True)
class Method:
    key: str
    label: str
    algorithm: dict[str, Any]
    straggler_mode: str
    color: str


def methods(mu: float) -> list[Method]:
    """Figure 1's three methods: FedAvg drops stragglers, FedProx keeps their partial work."""
    return [
        Method("fedavg", "FedAvg", {"name": "fedavg"}, "drop", "#2ca02c"),
        Method(
            "fedprox_mu0", "FedProx (μ=0)", {"name": "fedprox", "mu": 0.0}, "partial", "#1f77b4"
        ),
        Method(
            "fedprox_mu", f"FedProx (μ={mu:g})", {"name": "fedprox", "mu": mu}, "partial", "#d62728"
        ),
    ]


@dataclass
class Settings:
    rounds: int
    datasets: list[str]
    stragglers: list[float]
    out: Path
    executor: str
    threads: int | None
    eval_every: int
    mu: float
    seed: int
    test_fraction: float
    fresh: bool
    command: str


# -- one cell ---------------------------------------------------------------------------------
def pct(fraction: float) -> str:
    return f"{round(fraction * 100)}%"


def cell_dir(settings: Settings, ds: Dataset, stragglers: float, method: Method) -> Path:
    return (
        settings.out
        / "runs"
        / f"synthetic_{ds.key}-stragglers_{round(stragglers * 100)}-{method.key}"
    )


def make_config(settings: Settings, ds: Dataset, stragglers: float, method: Method) -> dict:
    return {
        "seed": settings.seed,
        "data": {
            "name": "synthetic",
            "test_fraction": settings.test_fraction,
            "synthetic": {"alpha": ds.alpha, "beta": ds.beta, "iid": ds.iid},
        },
        "model": {"name": "logreg"},
        "algorithm": dict(method.algorithm),
        "train": {
            "rounds": settings.rounds,
            "clients_per_round": DEVICES_PER_ROUND,
            "local_epochs": LOCAL_EPOCHS,
            "batch_size": BATCH_SIZE,
            "lr": LR,
            "stragglers": stragglers,
            "straggler_mode": method.straggler_mode,
        },
        "eval": {"every": settings.eval_every},
        # one checkpoint per evaluated round: the global model of each, for the training loss
        "checkpoint": {"every": settings.eval_every, "keep": settings.rounds},
        "executor": {"kind": settings.executor, "threads": settings.threads},
    }


def pooled_metrics(
    model: FunctionalModel, params: Any, buffers: Any, data: FederatedData, split: str
) -> tuple[float, float]:
    """(loss, accuracy) of one model over the union of every device's train or test data:
    the sample-weighted average the paper's train_error_and_loss() computes."""
    loss_sum = correct = 0.0
    n = 0
    for c in data.clients:
        x, y = (c.x_train, c.y_train) if split == "train" else (c.x_test, c.y_test)
        if len(y) == 0:
            continue
        s, k, m = model.evaluate(params, buffers, x, y, 4096)
        loss_sum, correct, n = loss_sum + s, correct + k, n + m
    return loss_sum / n, correct / n


def global_curves(run_dir: Path, result: Any, data: FederatedData, seed: int) -> dict[str, list]:
    """Per evaluated round (and round 0, the initial model): the global model's training loss
    and accuracy on all devices' training data (from the per-round checkpoints), its test loss
    and accuracy on the held-out data (the run's history) and the run's ``train_loss`` (mean
    minibatch loss of the round's local training)."""
    model = FunctionalModel(build_model("logreg", data.input_shape, data.num_outputs), data.task)
    init_params, init_buffers = model.initial_state(seed)  # the engine's initial model
    tr0 = pooled_metrics(model, init_params, init_buffers, data, "train")
    te0 = pooled_metrics(model, init_params, init_buffers, data, "test")
    curves: dict[str, list] = {
        "round": [0],
        "global_train_loss": [tr0[0]],
        "global_train_accuracy": [tr0[1]],
        "global_test_loss": [te0[0]],
        "global_test_accuracy": [te0[1]],
        "local_train_loss": [None],
    }
    history = {row["round"]: row for row in result.history}
    run = RunDir(run_dir)
    for path in run.checkpoints():
        payload = run.read_checkpoint(path)  # verified; never unpickled
        server = payload["server"]
        if not isinstance(server, dict) or "params" not in server:
            raise RuntimeError(f"{path}: no server params in the checkpoint")
        rnd = int(payload["round"])
        row = history[rnd]
        train = pooled_metrics(model, server["params"], server["buffers"], data, "train")
        test = pooled_metrics(model, server["params"], server["buffers"], data, "test")
        if abs(test[0] - row["global"]["loss"]) > 1e-4:  # the checkpoint holds that round's model
            raise RuntimeError(f"{path}: test loss {test[0]} != the run's {row['global']['loss']}")
        curves["round"].append(rnd)
        curves["global_train_loss"].append(train[0])
        curves["global_train_accuracy"].append(train[1])
        curves["global_test_loss"].append(row["global"]["loss"])
        curves["global_test_accuracy"].append(row["global"]["accuracy"])
        curves["local_train_loss"].append(row["train_loss"])
    missing = sorted(set(history) - set(curves["round"]))
    if missing:
        raise RuntimeError(f"{run_dir}: no checkpoint for evaluated rounds {missing[:5]}")
    return curves


def prune_checkpoints(run_dir: Path, keep: int = 2) -> None:
    """Keep the last ``keep`` checkpoints (fedloom's default), so the run stays resumable."""
    RunDir(run_dir).prune_checkpoints(keep)


def run_cell(
    settings: Settings, ds: Dataset, stragglers: float, method: Method, data: FederatedData
) -> dict[str, Any]:
    """Run one cell (or reuse a finished run directory) and return its record."""
    target = cell_dir(settings, ds, stragglers, method)
    record_path = target / "reproduce.json"
    config = make_config(settings, ds, stragglers, method)
    if record_path.is_file() and not settings.fresh:
        record = json.loads(record_path.read_text())
        if record.get("config") == config:
            record["reused"] = True
            return record
    if target.exists():  # unfinished, stale or --fresh: this script made it, start it over
        shutil.rmtree(target)
    start = time.perf_counter()
    result = fedloom.run(config, out=target, progress=False)
    seconds = time.perf_counter() - start
    curves = global_curves(target, result, data, settings.seed)
    prune_checkpoints(target)
    record = {
        "dataset": ds.key,
        "stragglers": stragglers,
        "method": method.key,
        "config": config,
        "seconds": seconds,
        "loop_seconds": result.summary["wall_seconds"],
        "executor_choice": result.summary["executor_choice"],
        "run_dir": str(target),
        "curves": curves,
    }
    record_path.write_text(json.dumps(record))
    record["reused"] = False
    return record


# -- metrics and the paper's claims -----------------------------------------------------------
def run_metrics(record: dict[str, Any], eval_every: int) -> dict[str, Any]:
    c = record["curves"]
    rounds, loss, acc = c["round"], c["global_train_loss"], c["global_test_accuracy"]
    last = rounds[-1]
    tail_from = last - max(1, last // 10)  # the last 10% of the rounds
    tail = [v for r, v in zip(rounds, loss, strict=True) if r > tail_from]
    tail_acc = [v for r, v in zip(rounds, acc, strict=True) if r > tail_from]
    half = [i for i, r in enumerate(rounds) if r > last / 2]
    steps = [abs(loss[i] - loss[i - 1]) for i in half if i > 0]
    span = rounds[half[-1]] - rounds[half[0] - 1] if half and half[0] > 0 else 0
    lag = max(1, round(PAPER_DIVERGE_LAG / eval_every))
    diverged_at = next(
        (rounds[i] for i in range(lag, len(loss)) if loss[i] - loss[i - lag] > PAPER_DIVERGE_GAP),
        None,
    )
    converged_at = next(
        (rounds[i] for i in range(1, len(loss)) if abs(loss[i] - loss[i - 1]) < PAPER_CONVERGE_TOL),
        None,
    )
    return {
        "train_loss_final": loss[-1],
        "train_loss_tail": sum(tail) / len(tail),
        "train_loss_min": min(loss),
        "test_accuracy_final": acc[-1],
        "test_accuracy_tail": sum(tail_acc) / len(tail_acc),
        "test_accuracy_best": max(acc[1:]) if len(acc) > 1 else acc[0],
        "loss_tv_per_round": sum(steps) / span if span else 0.0,
        "diverged_at": diverged_at,
        "converged_at": converged_at,
        "seconds": record["seconds"],
    }


@dataclass
class Claim:
    dataset: str
    stragglers: float | None
    source: str
    claim: str
    check: str
    holds: bool | None
    evidence: str


def _verdict(holds: bool | None) -> str:
    return {True: "yes", False: "NO", None: "n/a"}[holds]


def _f(v: float | None, digits: int = 3) -> str:
    return "—" if v is None else f"{v:.{digits}f}"


def paper_source(ds: Dataset, stragglers: float) -> str:
    if ds.key == "1_1":
        return "Fig. 1 + Fig. 7" + (", Fig. 2 + Fig. 6" if stragglers == 0 else "")
    if stragglers == 0:
        return "Fig. 2 + Fig. 6"
    if ds.iid:
        return "Fig. 5"
    return "not shown (Sec. 5.2's claim for the Fig. 1 datasets, extrapolated)"


def cell_claims(
    ds: Dataset, stragglers: float, ms: list[Method], metrics: dict[tuple, dict[str, Any]]
) -> list[Claim]:
    """The paper's qualitative claims for one (dataset, stragglers) cell, each checked on our
    numbers: training loss = mean global training loss over the last 10% of rounds."""
    fa, p0, p1 = (metrics.get((ds.key, stragglers, m.key)) for m in ms)
    la, l0, l1 = (m.label for m in ms)
    if fa is None or p0 is None or p1 is None:
        return []
    src = paper_source(ds, stragglers)
    out: list[Claim] = []

    def add(claim: str, check: str, holds: bool | None, evidence: str) -> None:
        out.append(Claim(ds.key, stragglers, src, claim, check, holds, evidence))

    def loss(m: dict[str, Any]) -> float:
        return m["train_loss_tail"]

    if stragglers == 0:
        same = (
            abs(loss(fa) - loss(p0)) < IDENTICAL_TOL
            and abs(fa["test_accuracy_final"] - p0["test_accuracy_final"]) < IDENTICAL_TOL
        )
        add(
            f"{l0} without stragglers is FedAvg",
            f"{la} and {l0} give the same numbers",
            same,
            f"loss {_f(loss(fa), 6)} vs {_f(loss(p0), 6)}",
        )
    elif not ds.iid:
        zero = metrics.get((ds.key, 0.0, ms[0].key))
        add(
            "Stragglers hurt FedAvg: larger heterogeneity, worse convergence",
            f"{la} loss here > {la} loss with 0% stragglers",
            None if zero is None else loss(fa) > loss(zero),
            "0% cell not run" if zero is None else f"{_f(loss(fa))} here vs {_f(loss(zero))} at 0%",
        )
        add(
            f"Keeping partial work helps: {l0} converges better than {la}",
            f"{l0} loss < {la} loss",
            loss(p0) < loss(fa),
            f"{_f(loss(p0))} vs {_f(loss(fa))}",
        )
    if ds.iid and stragglers == 0:
        add(
            "μ>0 may slow convergence on IID data",
            f"{l1} loss >= {l0} loss",
            loss(p1) >= loss(p0),
            f"{_f(loss(p1), 4)} vs {_f(loss(p0), 4)}",
        )
    elif ds.iid:
        rel = abs(loss(fa) - loss(p0)) / max(loss(p0), 1e-12)
        add(
            "FedAvg is robust to stragglers on IID data; partial work has little effect",
            f"{la} and {l0} losses within {SIMILAR_REL:.0%}, {la} does not diverge",
            rel < SIMILAR_REL and fa["diverged_at"] is None,
            f"{_f(loss(fa))} vs {_f(loss(p0))} ({rel:.1%}); diverged: {fa['diverged_at'] or 'no'}",
        )
    else:
        add(
            "The proximal term improves convergence",
            f"{l1} loss < {l0} loss",
            loss(p1) < loss(p0),
            f"{_f(loss(p1))} vs {_f(loss(p0))}",
        )
        add(
            "μ>0 is more stable",
            f"{l1} loss varies less round to round (2nd half) than {l0}",
            p1["loss_tv_per_round"] < p0["loss_tv_per_round"],
            f"{_f(p1['loss_tv_per_round'], 4)} vs {_f(p0['loss_tv_per_round'], 4)} per round",
        )
        add(
            "μ>0 keeps methods from diverging",
            f"{l1} never meets the paper's divergence rule (f_t - f_t-10 > 1)",
            p1["diverged_at"] is None,
            "diverged at round: "
            + ", ".join(
                f"{m.label} {r['diverged_at'] or 'never'}"
                for m, r in zip(ms, (fa, p0, p1), strict=True)
            ),
        )
        gain = p1["test_accuracy_final"] - fa["test_accuracy_final"]
        add(
            "FedProx improves test accuracy (Fig. 7: +22 points on average at 90%, 5 datasets)"
            if stragglers >= 0.9
            else "FedProx improves test accuracy",
            f"{l1} final test accuracy > {la}",
            gain > 0,
            f"{p1['test_accuracy_final']:.1%} vs {fa['test_accuracy_final']:.1%} "
            f"({gain * 100:+.1f} pts)",
        )
    return out


def figure2_claim(datasets: list[Dataset], ms: list[Method], metrics: dict) -> Claim | None:
    """Figure 2, top row: without stragglers, FedAvg converges worse as heterogeneity grows."""
    got = [(d, metrics.get((d.key, 0.0, ms[1].key))) for d in datasets]
    got = [(d, m) for d, m in got if m is not None]
    if len(got) < 2:
        return None
    losses = [m["train_loss_tail"] for _, m in got]
    return Claim(
        "all",
        0.0,
        "Fig. 2 (top row)",
        "More statistical heterogeneity, worse convergence of FedAvg (μ=0)",
        f"{ms[1].label} loss increases from left to right: " + " < ".join(d.label for d, _ in got),
        all(a < b for a, b in itertools.pairwise(losses)),
        ", ".join(f"{d.label} {_f(m['train_loss_tail'])}" for d, m in got),
    )


# -- outputs ----------------------------------------------------------------------------------
def setup_lines(settings: Settings) -> list[str]:
    return [
        "Setup: 30 devices, multinomial logistic regression (`logreg`), "
        f"{DEVICES_PER_ROUND} devices per round, E = {LOCAL_EPOCHS} local epochs, "
        f"batch size {BATCH_SIZE}, lr {LR}, "
        f"{settings.rounds} rounds, FedProx μ = {settings.mu:g} (the paper's best μ for the "
        f"synthetic data), seed {settings.seed}, {settings.test_fraction:.0%} of each device "
        "held out.",
        STRAGGLER_NOTE,
        "Training loss = the global model's cross-entropy on all 30 devices' training data "
        "(sample-weighted, as the paper's plots), computed from each round's checkpoint; "
        "'tail' = mean over the last 10% of rounds. Test accuracy = the global model on the union "
        "of the devices' held-out data. Loss TV = mean |f_t - f_t-1| per round over the second "
        f"half (oscillation). Diverged = the paper's rule f_t - f_t-10 > {PAPER_DIVERGE_GAP:g}; "
        f"converged = the paper's rule |f_t - f_t-1| < {PAPER_CONVERGE_TOL:g} (first round). "
        "Seconds = wall time of the run on this machine.",
    ]


TABLE_FIELDS = [
    ("dataset", "dataset"),
    ("stragglers", "stragglers"),
    ("method", "method"),
    ("train_loss_final", "train loss (final)"),
    ("train_loss_tail", "train loss (tail)"),
    ("test_accuracy_final", "test acc (final)"),
    ("test_accuracy_best", "test acc (best)"),
    ("loss_tv_per_round", "loss TV/round"),
    ("diverged_at", "diverged at"),
    ("converged_at", "converged at"),
    ("seconds", "seconds"),
]


def table_rows(
    settings: Settings, ms: list[Method], metrics: dict, claims: list[Claim]
) -> list[dict[str, Any]]:
    rows = []
    for dkey in settings.datasets:
        ds = DATASETS[dkey]
        for s in settings.stragglers:
            mine = [c for c in claims if c.dataset == dkey and c.stragglers == s]
            summary = "; ".join(f"{c.claim}: {_verdict(c.holds)}" for c in mine)
            for m in ms:
                got = metrics.get((dkey, s, m.key))
                if got is None:
                    continue
                rows.append(
                    {
                        "dataset": ds.label,
                        "stragglers": pct(s),
                        "method": m.label,
                        **got,
                        "paper_source": paper_source(ds, s),
                        "paper_claims_and_ours": summary,
                    }
                )
    return rows


def _md_cell(key: str, value: Any) -> str:
    if value is None:
        return "never" if key in ("diverged_at", "converged_at") else "—"
    if key.startswith("test_accuracy"):
        return f"{value:.1%}"
    if key.startswith("train_loss"):
        return f"{value:.4f}"
    if key == "loss_tv_per_round":
        return f"{value:.4f}"
    if key == "seconds":
        return f"{value:.0f}"
    return str(value)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    fields = [k for k, _ in TABLE_FIELDS] + [
        "train_loss_min",
        "test_accuracy_tail",
        "paper_source",
        "paper_claims_and_ours",
    ]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


def markdown(
    settings: Settings, rows: list[dict[str, Any]], claims: list[Claim], total: dict[str, float]
) -> str:
    lines = [
        "# FedProx (Li et al., MLSys 2020) Synthetic experiments, reproduced with fedloom",
        "",
        f"Command: `{settings.command}`",
        "",
        f"Runs: {len(rows)}; sum of run times {total['runs_s'] / 60:.1f} min; "
        f"this invocation {total['wall_s'] / 60:.1f} min "
        f"({int(total['reused'])} runs reused from an earlier invocation). "
        f"torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} threads.",
        "",
        *[line + "\n" for line in setup_lines(settings)],
        "## Results",
        "",
        "| " + " | ".join(h for _, h in TABLE_FIELDS) + " |",
        "|" + "---|" * len(TABLE_FIELDS),
    ]
    for row in rows:
        lines.append("| " + " | ".join(_md_cell(k, row.get(k)) for k, _ in TABLE_FIELDS) + " |")
    held = sum(c.holds is True for c in claims)
    checked = sum(c.holds is not None for c in claims)
    lines += [
        "",
        "## The paper's claims per cell, checked on these numbers",
        "",
        "The paper reports curves only (Figures 1, 2, 5, 6, 7), no per-cell numbers, so each cell "
        "lists the qualitative claim the paper makes and whether our run shows it (computed from "
        f"the table's numbers). {held} of {checked} checked claims hold.",
        "",
        "| dataset | stragglers | paper figure | claim | check | ours | evidence |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in claims:
        ds = DATASETS[c.dataset].label if c.dataset in DATASETS else c.dataset
        strag = "—" if c.stragglers is None else pct(c.stragglers)
        lines.append(
            f"| {ds} | {strag} | {c.source} | {c.claim} | {c.check} | **{_verdict(c.holds)}** "
            f"| {c.evidence} |"
        )
    return "\n".join(lines) + "\n"


def _loss_cap(records: list[dict[str, Any]], key: str) -> float | None:
    """An upper y limit that keeps the converging curves readable next to a diverging one."""
    values = [v for r in records for v in r["curves"][key] if v is not None]
    if not values:
        return None
    typical = sorted(values)[int(0.95 * (len(values) - 1))]
    first = max(r["curves"][key][0] or 0.0 for r in records)
    cap = 1.1 * max(typical, first)
    return cap if max(values) > cap else None


def straggler_figures(
    settings: Settings, ms: list[Method], records: dict[tuple, dict], stragglers: float
) -> list[tuple[str, go.Figure]]:
    """Figure 1's layout: one column per dataset; rows training loss and test accuracy; one
    line per method. A second figure has the diagnostics (test loss, local minibatch loss)."""
    dss = [DATASETS[k] for k in settings.datasets]
    panels = [
        (
            "Figure 1 layout",
            [
                ("global_train_loss", "Training loss (global model, all training data)"),
                ("global_test_accuracy", "Test accuracy (global model, held-out data)"),
            ],
        ),
        (
            "Diagnostics",
            [
                ("global_test_loss", "Test loss (global model, held-out data)"),
                ("local_train_loss", "Mean local minibatch loss (fedloom train_loss)"),
            ],
        ),
    ]
    figures = []
    for title, rows in panels:
        fig = make_subplots(
            rows=len(rows),
            cols=len(dss),
            subplot_titles=[d.label for d in dss],
            shared_xaxes=True,
            vertical_spacing=0.08,
            horizontal_spacing=0.05,
        )
        for col, ds in enumerate(dss, start=1):
            cell = [
                records[(ds.key, stragglers, m.key)]
                for m in ms
                if (ds.key, stragglers, m.key) in records
            ]
            for row, (key, ylabel) in enumerate(rows, start=1):
                for m in ms:
                    rec = records.get((ds.key, stragglers, m.key))
                    if rec is None:
                        continue
                    fig.add_trace(
                        go.Scatter(
                            x=rec["curves"]["round"],
                            y=rec["curves"][key],
                            mode="lines",
                            name=m.label,
                            legendgroup=m.key,
                            showlegend=(col == 1 and row == 1),
                            line={"color": m.color, "width": 1.6},
                        ),
                        row=row,
                        col=col,
                    )
                if "loss" in key and cell:
                    cap = _loss_cap(cell, key)
                    if cap is not None:
                        fig.update_yaxes(range=[0, cap], row=row, col=col)
                if col == 1:
                    fig.update_yaxes(title_text=ylabel, title_font={"size": 11}, row=row, col=col)
                if row == len(rows):
                    fig.update_xaxes(title_text="# rounds", row=row, col=col)
        fig.update_layout(
            title=f"{title}: {pct(stragglers)} stragglers",
            template="plotly_white",
            height=330 * len(rows),
            width=max(700, 330 * len(dss)),
            legend={"orientation": "h", "y": -0.12},
            margin={"t": 70, "l": 60, "r": 20},
        )
        figures.append((title, fig))
    return figures


def write_html(
    settings: Settings,
    ms: list[Method],
    records: dict[tuple, dict],
    table_md: str,
    png: bool,
) -> list[Path]:
    parts: list[str] = []
    pngs: list[Path] = []
    first = True
    for s in settings.stragglers:
        parts.append(f"<h2 id='s{round(s * 100)}'>{pct(s)} stragglers</h2>")
        for title, fig in straggler_figures(settings, ms, records, s):
            parts.append(fig.to_html(full_html=False, include_plotlyjs=first))
            first = False
            if png and title == "Figure 1 layout":
                target = settings.out / f"curves_stragglers{round(s * 100)}.png"
                fig.write_image(target, scale=2)
                pngs.append(target)
    nav = " · ".join(f"<a href='#s{round(s * 100)}'>{pct(s)}</a>" for s in settings.stragglers)
    notes = "".join(f"<p>{_escape(line)}</p>" for line in setup_lines(settings))
    page = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        "<title>FedProx Synthetic reproduction</title>"
        "<style>body{font-family:sans-serif;margin:1.5em;max-width:1500px}"
        "pre{white-space:pre-wrap;font-size:12px;background:#f6f6f6;padding:1em}</style>"
        "</head><body>"
        "<h1>FedProx (Li et al., MLSys 2020) Synthetic experiments, reproduced with fedloom</h1>"
        f"<p>Straggler levels: {nav}</p>{notes}{''.join(parts)}"
        f"<h2>Table</h2><pre>{_escape(table_md)}</pre></body></html>"
    )
    (settings.out / "curves.html").write_text(page, encoding="utf-8")
    return pngs


def _escape(text: str) -> str:
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def kaleido_available() -> bool:
    try:
        import kaleido  # noqa: F401
    except ImportError:
        return False
    return True


# -- main -------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> Settings:
    p = argparse.ArgumentParser(
        description="Reproduce FedProx's Synthetic experiments (Figure 1 layout) with fedloom."
    )
    p.add_argument("--rounds", type=int, default=200, help="rounds per run (paper: 200)")
    p.add_argument(
        "--datasets",
        default=",".join(DATASETS),
        help=f"comma-separated, from {', '.join(DATASETS)} (default: all four)",
    )
    p.add_argument(
        "--stragglers", default="0,0.5,0.9", help="comma-separated fractions (default 0,0.5,0.9)"
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    p.add_argument(
        "--executor",
        default="auto",
        choices=["auto", "sequential", "vectorized"],
        help="fedloom executor.kind (default auto)",
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="intra-op threads per run (default 1; 0 = torch's default, all cores)",
    )
    p.add_argument("--eval-every", type=int, default=1, help="evaluate every N rounds (default 1)")
    p.add_argument("--mu", type=float, default=DEFAULT_MU, help="FedProx mu > 0 (paper: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--test-fraction",
        type=float,
        default=DEFAULT_TEST_FRACTION,
        help="held-out share of each device (released FedProx data: 0.1)",
    )
    p.add_argument(
        "--fresh", action="store_true", help="rerun cells whose finished run directory exists"
    )
    args = p.parse_args(argv)
    datasets = [k.strip() for k in args.datasets.split(",") if k.strip()]
    unknown = [k for k in datasets if k not in DATASETS]
    if unknown or not datasets:
        p.error(f"--datasets: unknown {unknown}; choose from {', '.join(DATASETS)}")
    try:
        stragglers = [float(v) for v in args.stragglers.split(",") if v.strip()]
    except ValueError:
        p.error(f"--stragglers: expected comma-separated fractions, got {args.stragglers!r}")
    if not stragglers or any(not 0 <= s < 1 for s in stragglers):
        p.error("--stragglers: fractions in [0, 1)")
    if args.rounds < 1 or args.eval_every < 1:
        p.error("--rounds and --eval-every must be >= 1")
    if args.mu <= 0:
        p.error("--mu must be > 0 (mu = 0 is always run)")
    argv_used = sys.argv[1:] if argv is None else argv
    return Settings(
        rounds=args.rounds,
        datasets=[k for k in DATASETS if k in datasets],
        stragglers=sorted(set(stragglers)),
        out=args.out,
        executor=args.executor,
        threads=args.threads or None,
        eval_every=args.eval_every,
        mu=args.mu,
        seed=args.seed,
        test_fraction=args.test_fraction,
        fresh=args.fresh,
        command=" ".join(["python", SCRIPT, *map(shlex.quote, argv_used)]),
    )


def main(argv: list[str] | None = None) -> dict[str, Any]:
    settings = parse_args(argv)
    console = Console(stderr=True)
    ms = methods(settings.mu)
    settings.out.mkdir(parents=True, exist_ok=True)
    # results are regenerated; only table.md is meant to be committed
    (settings.out / ".gitignore").write_text("*\n!table.md\n")
    cells = [
        (DATASETS[d], s, m) for d in settings.datasets for s in settings.stragglers for m in ms
    ]
    records: dict[tuple, dict[str, Any]] = {}
    datas: dict[str, FederatedData] = {}
    start = time.perf_counter()
    columns = (
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
    )
    with Progress(*columns, console=console) as progress:
        task = progress.add_task("cells", total=len(cells))
        for i, (ds, s, m) in enumerate(cells, start=1):
            name = f"{ds.label} · {pct(s)} stragglers · {m.label}"
            progress.update(task, description=f"[{i}/{len(cells)}] {name}")
            if ds.key not in datas:
                cfg = parse_config(make_config(settings, ds, s, m))
                datas[ds.key] = load_dataset(cfg.data, cfg.seed)
            rec = run_cell(settings, ds, s, m, datas[ds.key])
            records[(ds.key, s, m.key)] = rec
            got = run_metrics(rec, settings.eval_every)
            progress.console.print(
                f"[{i}/{len(cells)}] {name}: train loss {got['train_loss_final']:.4f}, "
                f"test acc {got['test_accuracy_final']:.1%} "
                f"(best {got['test_accuracy_best']:.1%}), "
                f"{rec['seconds']:.0f} s{' (reused)' if rec['reused'] else ''}"
            )
            progress.advance(task)
    metrics = {key: run_metrics(rec, settings.eval_every) for key, rec in records.items()}
    claims: list[Claim] = []
    dss = [DATASETS[k] for k in settings.datasets]
    for ds in dss:
        for s in settings.stragglers:
            claims += cell_claims(ds, s, ms, metrics)
    fig2 = figure2_claim(dss, ms, metrics)
    if fig2 is not None:
        claims.append(fig2)
    total = {
        "runs_s": sum(r["seconds"] for r in records.values()),
        "wall_s": time.perf_counter() - start,
        "reused": sum(bool(r["reused"]) for r in records.values()),
    }
    rows = table_rows(settings, ms, metrics, claims)
    table_md = markdown(settings, rows, claims, total)
    (settings.out / "table.md").write_text(table_md, encoding="utf-8")
    write_csv(settings.out / "table.csv", rows)
    png = kaleido_available()
    pngs = write_html(settings, ms, records, table_md, png)
    results = {
        "settings": {**asdict(settings), "out": str(settings.out)},
        "total": total,
        "rows": rows,
        "claims": [asdict(c) for c in claims],
        "runs": [{k: v for k, v in rec.items() if k != "reused"} for rec in records.values()],
    }
    (settings.out / "results.json").write_text(json.dumps(results))
    print(table_md, flush=True)
    console.print(
        f"wrote {settings.out / 'table.md'}, table.csv, results.json, curves.html"
        + (f", {len(pngs)} PNGs" if pngs else " (no PNG: kaleido is not installed)")
    )
    return results


if __name__ == "__main__":
    main()
