"""fedloom against plain Flower 1.42 simulation, side by side, in one process (issue #26).

Usage (from the repository root, MNIST under $FEDLOOM_DATA)::

    FEDLOOM_DATA=../shared/data FEDLOOM_OFFLINE=1 \\
        .venv/bin/python benchmarks/flower_baseline.py [--setting small|large|both]
        [--rounds R] [--quick] [--executors auto,sequential,vectorized,processes]
        [--repeats N] [--actors 2] [--flower-loader dataloader|index]

Settings (FedAvg, MNIST IID over 100 clients of 480 training samples, the 2NN 784-200-200-10,
1 local epoch, the global model evaluated on the 10k MNIST test set after every round):

- ``small``: 10 of 100 clients per round, batch 10, lr 0.1, 20 rounds;
- ``large``: all 100 clients per round, batch 32, lr 0.05, 5 rounds.

The Flower side is what a Flower user writes: a ``ClientApp`` whose train function runs a
PyTorch loop (``DataLoader``, ``torch.optim.SGD``, one torch thread), a ``ServerApp`` running
Flower's own message-API ``FedAvg`` with a centralized ``evaluate_fn`` on the test set, and
``flwr.simulation.run_simulation`` on Ray with 2 actors of 1 CPU. The fedloom side is
``fedloom.run`` with each executor. Both sides get the same split (built by fedloom's data API
with the same seed; checked equal), start from the same initial weights and evaluate the same
10k test images each round. A round is timed from one evaluation's end to the next; the whole
run from before the data is built to after the run returns (Flower: with Ray's start and
shutdown). Progress and Flower's logs go to
stderr; stdout has the table and, as its last line, one JSON object. See benchmarks/README.md.
"""

from __future__ import annotations

import os

if not any(v in os.environ for v in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")):
    # what ``import fedloom`` does before torch loads (engine/threads.py), set here so that
    # both sides (and Ray's actors, which inherit it) run under the same OpenMP wait policy
    # without Flower's actors importing fedloom
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import argparse
import hashlib
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid, ServerApp
from flwr.serverapp.strategy import FedAvg
from flwr.simulation import run_simulation
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

if TYPE_CHECKING:
    from fedloom.data import FederatedData

SEED = 0
EXECUTORS = ("auto", "auto+monitor", "sequential", "vectorized", "processes")
"""fedloom contenders: ``executor.kind`` values, and ``processes``: the sequential executor in
one 1-thread worker process per core (``workers: <cores>``), one of auto's candidates;
``+monitor``: with fedloom's monitoring on (fedloom_config)."""
TARGETS = {
    "small": {"per_round": 3.0, "whole_run": 3.0},
    "large": {"per_round": 4.0, "whole_run": 3.0},
}
"""Issue #26: Flower / fedloom at least this much."""
ACCURACY_TOLERANCE = 0.03
"""Final accuracies of the two sides may differ by this much (3 points) before CHECK FAILED."""


@dataclass(frozen=True)
class Setting:
    """One benchmark setting (FedAvg on MNIST, the 2NN)."""

    name: str
    clients: int
    per_round: int
    batch: int
    lr: float
    rounds: int
    train_samples: int | None = None
    """Training samples kept per client (None: all of fedloom's split, 480 on MNIST/100)."""
    test_samples: int = 10_000
    """The first this many of the official MNIST test images are evaluated."""


SETTINGS = {
    "small": Setting("small", clients=100, per_round=10, batch=10, lr=0.1, rounds=20),
    "large": Setting("large", clients=100, per_round=100, batch=32, lr=0.05, rounds=5),
}
QUICK_ROUNDS = {"small": 4, "large": 2}


def log(message: str) -> None:
    print(f"[flower_baseline] {message}", file=sys.stderr, flush=True)


# -- the shared data ----------------------------------------------------------------------------
def fedloom_config(setting: Setting, executor: str) -> dict[str, Any]:
    """fedloom's config of ``setting`` (evaluation every round, no run directory). The
    contender ``<executor>+monitor`` keeps fedloom's training-health monitoring on (its
    default: update norms, the clients' cosine matrix and zeta^2 from 10 clients' gradients
    every evaluated round, engine/monitoring.py); plain ``<executor>`` turns it off, so that
    both sides do the same work (train, aggregate, evaluate the test set)."""
    executor, _, extra = executor.partition("+")
    return {
        "seed": SEED,
        "data": {
            "name": "mnist",
            "num_clients": setting.clients,
            "partition": {"kind": "iid"},
        },
        "model": {"name": "mlp"},
        "algorithm": {"name": "fedavg"},
        "train": {
            "rounds": setting.rounds,
            "clients_per_round": setting.per_round,
            "local_epochs": 1,
            "batch_size": setting.batch,
            "lr": setting.lr,
        },
        "eval": {"every": 1},
        "monitor": {"enabled": extra == "monitor"},
        "executor": executor_config(executor),
    }


def executor_config(executor: str) -> dict[str, Any]:
    """The ``executor`` section of contender ``executor`` (see EXECUTORS)."""
    if executor == "processes":
        return {"kind": "sequential", "workers": os.cpu_count() or 1}
    return {"kind": executor}


def initial_weights() -> list[torch.Tensor]:
    """fedloom's initial 2NN (``mlp``, seed 0), its parameters in order: Flower's server
    starts from the same model, so that the final accuracies can be compared."""
    from fedloom.core.functional import FunctionalModel
    from fedloom.models import build_model

    module = build_model("mlp", (1, 28, 28), 10)
    params, _ = FunctionalModel(module, "classification").initial_state(SEED)
    return list(params.values())


def mnist_test_set(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``n`` official MNIST test images (float32 (n, 1, 28, 28) in [0, 1], as
    fedloom scales its training images) and labels."""
    from fedloom.data import default_root, load_mnist_arrays

    _, _, x, y = load_mnist_arrays(default_root())
    images = torch.from_numpy(np.array(x[:n])).to(torch.float32).div_(255.0)
    return images.unsqueeze(1), torch.from_numpy(y[:n].astype(np.int64))


def build_data(setting: Setting) -> tuple[FederatedData, tuple[torch.Tensor, torch.Tensor]]:
    """fedloom's split of ``setting`` (``data.name: mnist``, IID, seed 0, its default
    test_fraction 0.2), each client's held-out share replaced by a shard of the official test
    set, so that fedloom's per-round evaluation of the global model (pooled over the clients'
    test sets) is exactly the evaluation on those test images."""
    from fedloom.config import resolve_config
    from fedloom.data import ClientData, load_dataset

    cfg = resolve_config(fedloom_config(setting, "sequential"))
    data = load_dataset(cfg.data, cfg.seed)
    test = test_x, test_y = mnist_test_set(setting.test_samples)
    shards = zip(
        torch.tensor_split(test_x, setting.clients),
        torch.tensor_split(test_y, setting.clients),
        strict=True,
    )
    cap = setting.train_samples
    clients = [
        ClientData(c.x_train[:cap], c.y_train[:cap], tx, ty)
        for c, (tx, ty) in zip(data.clients, shards, strict=True)
    ]
    return replace(data, clients=clients), test


def split_digest(data: FederatedData) -> str:
    """A digest of every client's training tensors (the split both sides train on)."""
    h = hashlib.sha256()
    for c in data.clients:
        h.update(c.x_train.contiguous().numpy().tobytes())
        h.update(c.y_train.contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def warm_up(setting: Setting) -> str:
    """Build ``setting``'s data once, untimed (fedloom's import, the IDX files' first read,
    which fedloom caches per process), so that the side that runs first does not pay for
    them; returns the split's digest, which every run must reproduce."""
    return split_digest(build_data(setting)[0])


# -- the Flower side: what a Flower 1.42 user writes ---------------------------------------------
def make_net() -> nn.Module:
    """The FedAvg paper's 2NN, as a plain nn.Sequential (same layers as fedloom's ``mlp``)."""
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(784, 200),
        nn.ReLU(),
        nn.Linear(200, 200),
        nn.ReLU(),
        nn.Linear(200, 10),
    )


_PARTITIONS: dict[str, dict[str, Any]] = {}
"""The partition file, loaded once per Ray actor (memory-mapped)."""


def load_partition(path: str, partition_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client ``partition_id``'s training tensors from the file that the driver wrote."""
    if path not in _PARTITIONS:
        _PARTITIONS[path] = torch.load(path, mmap=True, weights_only=True)
    saved = _PARTITIONS[path]
    lo, hi = saved["offsets"][partition_id], saved["offsets"][partition_id + 1]
    return saved["x"][lo:hi], saved["y"][lo:hi]


def write_partitions(data: FederatedData, path: Path) -> None:
    """Every client's training tensors in one file, with offsets (the Flower clients' data)."""
    sizes = [c.num_train for c in data.clients]
    torch.save(
        {
            "x": torch.cat([c.x_train for c in data.clients]),
            "y": torch.cat([c.y_train for c in data.clients]),
            "offsets": np.concatenate([[0], np.cumsum(sizes)]).tolist(),
        },
        path,
    )


def minibatches(
    x: torch.Tensor, y: torch.Tensor, batch: int, loader: str
) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """One epoch of shuffled minibatches: a ``DataLoader`` over a ``TensorDataset`` (what
    Flower's PyTorch examples use), or ``index``: slices of one random permutation."""
    if loader == "index":
        order = torch.randperm(len(x))
        return [(x[i], y[i]) for i in order.split(batch)]
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=True)


client_app = ClientApp()


@client_app.train()
def flower_train(msg: Message, context: Context) -> Message:
    """One round of local training: 1 epoch of SGD over the client's shuffled minibatches."""
    torch.set_num_threads(1)
    config = msg.content["config"]
    x, y = load_partition(str(config["data"]), int(context.node_config["partition-id"]))
    model = make_net()
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    batches = minibatches(x, y, int(config["batch-size"]), str(config["loader"]))
    optimizer = torch.optim.SGD(model.parameters(), lr=float(config["lr"]))
    model.train()
    total = 0.0
    for xb, yb in batches:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(xb), yb)
        loss.backward()
        optimizer.step()
        total += loss.item() * len(yb)
    metrics = MetricRecord({"train_loss": total / len(x), "num-examples": len(x)})
    content = RecordDict({"arrays": ArrayRecord(model.state_dict()), "metrics": metrics})
    return Message(content=content, reply_to=msg)


@torch.no_grad()
def evaluate_net(
    net: nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int = 1024
) -> tuple[float, float]:
    """(mean loss, accuracy) of ``net`` on ``(x, y)``."""
    net.eval()
    loss, correct = 0.0, 0
    for lo in range(0, len(x), batch):
        out = net(x[lo : lo + batch])
        loss += F.cross_entropy(out, y[lo : lo + batch], reduction="sum").item()
        correct += int((out.argmax(1) == y[lo : lo + batch]).sum())
    return loss / len(x), correct / len(x)


def flower_server_app(
    setting: Setting,
    data_path: str,
    test: tuple[torch.Tensor, torch.Tensor],
    initial: list[torch.Tensor],
    out: dict[str, Any],
    loader: str = "dataloader",
) -> ServerApp:
    """The ServerApp: Flower's FedAvg (message API) from the weights ``initial``, centralized
    evaluation every round; ``out`` gets the evaluation times and results."""
    app = ServerApp()
    stamps: list[float] = []
    evaluations: list[dict[str, float]] = []
    out["stamps"], out["evaluations"] = stamps, evaluations

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        net = make_net()
        with torch.no_grad():
            for p, w in zip(net.parameters(), initial, strict=True):
                p.copy_(w)
        strategy = FedAvg(
            fraction_train=setting.per_round / setting.clients,
            fraction_evaluate=0.0,  # no federated evaluation: centralized, as in fedloom
            min_train_nodes=setting.per_round,
            min_available_nodes=setting.clients,
        )

        def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
            if server_round == 0:  # the initial model is not evaluated (fedloom does not)
                stamps.append(time.perf_counter())
                return None
            net.load_state_dict(arrays.to_torch_state_dict())
            loss, accuracy = evaluate_net(net, *test)
            stamps.append(time.perf_counter())
            evaluations.append({"round": server_round, "loss": loss, "accuracy": accuracy})
            return MetricRecord({"loss": loss, "accuracy": accuracy})

        strategy.start(
            grid=grid,
            initial_arrays=ArrayRecord(net.state_dict()),
            num_rounds=setting.rounds,
            train_config=ConfigRecord(
                {
                    "lr": setting.lr,
                    "batch-size": setting.batch,
                    "data": data_path,
                    "loader": loader,
                }
            ),
            evaluate_fn=evaluate,
        )

    return app


def run_flower(setting: Setting, actors: int = 2, loader: str = "dataloader") -> dict[str, Any]:
    """The whole Flower run, timed from before the data is built to after ``run_simulation``
    returned (Ray started, actors made, rounds, Ray shut down); ``actors`` Ray actors of 1
    CPU, the clients' minibatches from ``loader`` (see :func:`minibatches`)."""
    tmp = Path(tempfile.mkdtemp(prefix="flower_baseline-"))
    out: dict[str, Any] = {}
    initial = initial_weights()
    try:
        start = time.perf_counter()
        data, test = build_data(setting)
        write_partitions(data, tmp / "partitions.pt")
        built = time.perf_counter()
        run_simulation(
            server_app=flower_server_app(
                setting, str(tmp / "partitions.pt"), test, initial, out, loader
            ),
            client_app=client_app,
            num_supernodes=setting.clients,
            backend_config={
                "init_args": {"num_cpus": actors},
                "client_resources": {"num_cpus": 1, "num_gpus": 0.0},
            },
        )
        whole = time.perf_counter() - start
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    stamps, evaluations = out.get("stamps", []), out.get("evaluations", [])
    if len(evaluations) != setting.rounds:
        raise RuntimeError(
            f"Flower ran {len(evaluations)} of {setting.rounds} rounds (see its log on stderr)"
        )
    return {
        **describe_rounds([b - a for a, b in itertools.pairwise(stamps)]),
        "whole_run_s": round(whole, 3),
        "data_setup_s": round(built - start, 3),
        "accuracy": evaluations[-1]["accuracy"],
        "loss": evaluations[-1]["loss"],
        "split": split_digest(data),
    }


# -- the fedloom side ---------------------------------------------------------------------------
def run_fedloom(setting: Setting, executor: str) -> dict[str, Any]:
    """One ``fedloom.run`` with ``executor``, timed from before the data is built to after the
    run returned; a round's seconds from the metrics rows' ``wall_seconds``."""
    import fedloom

    start = time.perf_counter()
    data, _ = build_data(setting)
    result = fedloom.run(fedloom_config(setting, executor), data=data, write=False, progress=False)
    whole = time.perf_counter() - start
    walls = [row["wall_seconds"] for row in result.history]
    final = result.summary["final"]["global"]
    return {
        **describe_rounds([b - a for a, b in zip([0.0, *walls], walls, strict=False)]),
        "whole_run_s": round(whole, 3),
        "accuracy": final["accuracy"],
        "loss": final["loss"],
        "executor_choice": result.summary["executor_choice"],
        "split": split_digest(data),
    }


# -- the comparison -----------------------------------------------------------------------------
def describe_rounds(rounds: list[float]) -> dict[str, Any]:
    """The first round apart (Ray's start; fedloom's first calls); ``per_round_s``: the mean of the
    others (Flower's rounds come in steps of its 0.1 s polling, which a median would jump
    between), their median beside it."""
    rest = rounds[1:] or rounds
    return {
        "first_round_s": round(rounds[0], 4),
        "per_round_s": round(statistics.fmean(rest), 4),
        "median_round_s": round(statistics.median(rest), 4),
        "rounds_s": [round(r, 4) for r in rounds],
    }


def compare(
    setting: Setting,
    executors: list[str],
    repeats: int,
    digest: str,
    actors: int = 2,
    loader: str = "dataloader",
) -> dict[str, Any]:
    """Flower first, then fedloom with each executor; ``repeats`` times; the fastest repeat of
    each side is kept (by whole-run time). Every run must train on the split ``digest``."""
    flower: list[dict[str, Any]] = []
    fed: dict[str, list[dict[str, Any]]] = {e: [] for e in executors}
    for r in range(repeats):
        log(f"{setting.name}: Flower (repeat {r + 1}/{repeats})")
        flower.append(run_flower(setting, actors, loader))
        log(f"{setting.name}: Flower {flower[-1]['whole_run_s']} s")
        for executor in executors:
            log(f"{setting.name}: fedloom {executor} (repeat {r + 1}/{repeats})")
            fed[executor].append(run_fedloom(setting, executor))
            log(f"{setting.name}: fedloom {executor} {fed[executor][-1]['whole_run_s']} s")
    best_flower = min(flower, key=lambda e: e["whole_run_s"])
    entry: dict[str, Any] = {
        "setting": asdict(setting),
        "flower": {**best_flower, "actors": actors, "loader": loader},
        "fedloom": {e: min(runs, key=lambda x: x["whole_run_s"]) for e, runs in fed.items()},
        "ratios": {},
        "targets": TARGETS.get(setting.name),
        "check": "ok",
    }
    problems = []
    for executor, mine in entry["fedloom"].items():
        entry["ratios"][executor] = {
            "per_round": round(best_flower["per_round_s"] / mine["per_round_s"], 2),
            "whole_run": round(best_flower["whole_run_s"] / mine["whole_run_s"], 2),
        }
        gap = abs(best_flower["accuracy"] - mine["accuracy"])
        if gap > ACCURACY_TOLERANCE:
            problems.append(
                f"{setting.name}: final accuracy Flower {best_flower['accuracy']:.4f} against "
                f"fedloom {executor} {mine['accuracy']:.4f} (more than "
                f"{ACCURACY_TOLERANCE * 100:.0f} points apart)"
            )
    for side, runs in [("Flower", flower), *((f"fedloom {e}", fed[e]) for e in executors)]:
        if any(one["split"] != digest for one in runs):
            problems.append(f"{setting.name}: {side} trained on another split")
    if problems:
        entry["check"] = "CHECK FAILED: " + "; ".join(problems)
    return entry


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """The table printed before the JSON line."""
    head = (
        f"{'setting':<8} {'side':<42} {'1st round s':>11} {'s/round':>8} {'whole run s':>11} "
        f"{'final acc':>9} {'Flower/x round':>14} {'Flower/x run':>12}"
    )
    lines = [head, "-" * len(head)]
    for name, entry in results.items():
        fl = entry["flower"]
        side = f"Flower 1.42 (Ray, {fl['actors']} actors, {fl['loader']})"
        lines.append(
            f"{name:<8} {side:<42} {fl['first_round_s']:>11.3f} "
            f"{fl['per_round_s']:>8.3f} {fl['whole_run_s']:>11.2f} {fl['accuracy']:>9.4f} "
            f"{'':>14} {'':>12}"
        )
        for executor, mine in entry["fedloom"].items():
            ratio = entry["ratios"][executor]
            side = f"fedloom {executor}"
            if executor == "auto":
                side += f" (picked {mine['executor_choice']})"
            lines.append(
                f"{name:<8} {side:<42} {mine['first_round_s']:>11.3f} "
                f"{mine['per_round_s']:>8.3f} {mine['whole_run_s']:>11.2f} "
                f"{mine['accuracy']:>9.4f} {ratio['per_round']:>13.2f}x "
                f"{ratio['whole_run']:>11.2f}x"
            )
        targets = entry["targets"]
        if targets:
            best = max(entry["ratios"].values(), key=lambda r: r["per_round"])
            auto = entry["ratios"].get("auto")
            shown = f"auto {auto['per_round']}x / {auto['whole_run']}x, " if auto else ""
            lines.append(
                f"{'':<8} target (issue #26): >= {targets['per_round']}x per round, >= "
                f"{targets['whole_run']}x whole run; measured {shown}best per round "
                f"{best['per_round']}x / {best['whole_run']}x"
            )
        if entry["check"] != "ok":
            lines.append(entry["check"])
        lines.append("")
    lines.append(
        "s/round: mean of rounds 2..R (a round: training, aggregation and the evaluation of "
        "the 10k test images); 1st round: with Ray's start (Flower) or the first calls (fedloom); "
        "whole run: data set-up to return. Read the ratios: the machine is shared."
    )
    return "\n".join(lines)


def settings_from(args: argparse.Namespace) -> list[Setting]:
    names = ["small", "large"] if args.setting == "both" else [args.setting]
    chosen = []
    for name in names:
        setting = SETTINGS[name]
        rounds = args.rounds or (QUICK_ROUNDS[name] if args.quick else setting.rounds)
        chosen.append(replace(setting, rounds=rounds))
    return chosen


def run(
    settings: list[Setting],
    executors: list[str] | tuple[str, ...] = EXECUTORS,
    repeats: int = 1,
    actors: int = 2,
    loader: str = "dataloader",
) -> dict[str, Any]:
    """Every setting, Flower then fedloom; the JSON result keyed by setting name."""
    results: dict[str, Any] = {}
    for setting in settings:
        digest = warm_up(setting)
        results[setting.name] = compare(setting, list(executors), repeats, digest, actors, loader)
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--setting", choices=["small", "large", "both"], default="both")
    parser.add_argument("--rounds", type=int, default=None, help="override every setting's")
    parser.add_argument("--quick", action="store_true", help=f"smoke run: rounds {QUICK_ROUNDS}")
    parser.add_argument("--executors", default=",".join(EXECUTORS))
    parser.add_argument("--repeats", type=int, default=1, help="keep each side's fastest")
    parser.add_argument("--actors", type=int, default=2, help="Flower's Ray actors (1 CPU each)")
    parser.add_argument(
        "--flower-loader",
        choices=["dataloader", "index"],
        default="dataloader",
        help="Flower clients' minibatches: a DataLoader, or slices of a permutation",
    )
    args = parser.parse_args(argv)
    executors = [e for e in args.executors.split(",") if e]
    results = run(settings_from(args), executors, args.repeats, args.actors, args.flower_loader)
    results["environment"] = {
        "flwr": _version("flwr"),
        "ray": _version("ray"),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default"),
    }
    print(format_table({k: v for k, v in results.items() if k != "environment"}))
    print(json.dumps(results))
    return results


def _version(package: str) -> str:
    from importlib.metadata import version

    return version(package)


if __name__ == "__main__":
    # run as this file's importable module, so that Ray's actors import the ClientApp's train
    # function by reference (its directory is on the path that Flower hands to Ray)
    import flower_baseline

    flower_baseline.main()
