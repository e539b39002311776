"""fedloom against pfl-research 0.6.0, side by side in one process (issue #37, item 6).

Usage (from the repository root; pfl is a benchmark-only dependency,
``pip install -r benchmarks/requirements-pfl.txt``)::

    FEDLOOM_DATA=../shared/data FEDLOOM_OFFLINE=1 PYTHONPATH=src \\
        python benchmarks/pfl_baseline.py [--settings pfl_cifar10,fedavg_2nn]
        [--executors auto,sequential] [--rounds 3] [--repeats 2] [--quick] [--json OUT]

Settings (peer_settings.py): ``pfl_cifar10`` (pfl-research's CIFAR-10 ``baseline.yaml``
shape with its ``simple_cnn``, synthetic images) and ``fedavg_2nn`` (the FedAvg paper's MNIST
2NN, 10 of 100 clients a round, B = 10, E = 1).

The pfl side is what a pfl user writes: ``PyTorchModel`` (local ``torch.optim.SGD``, central
SGD at lr 1), ``FederatedAveraging``, ``SimulatedBackend`` over a ``FederatedDataset`` of
per-user ``Dataset([x, y])``, no evaluation; a round is timed between two
``after_central_iteration`` callbacks. The fedloom side is ``Engine.train_round`` with the same
module and arrays (roofline.Runner; ``fedloom.run`` does the same per round, plus evaluation).
Each repeat runs pfl for 1 + ``--rounds``
rounds, then every fedloom executor for 1 + ``--rounds`` (the first round of each is a warm-up);
a side's seconds per round is the median of its timed rounds over all repeats. Both sides run
under one OpenMP wait policy: fedloom's ``OMP_WAIT_POLICY=PASSIVE`` (engine/threads.py), or
with ``--omp-spin`` libgomp's default spinning, which a plain pfl script runs under.
Exit status 2 when pfl is not installed. See benchmarks/README.md, "pfl_baseline.py".
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import sys
import time
from typing import Any

import openmp_policy  # noqa: F401  (first: OpenMP's wait policy, before torch loads)
import peer_settings
import roofline
import torch
from torch import nn
from torch.nn import functional as F

PFL_VERSION = "0.6.0"
MISSING = (
    f"pfl_baseline.py needs pfl-research {PFL_VERSION} (a benchmark-only dependency): "
    "pip install -r benchmarks/requirements-pfl.txt"
)


def log(message: str) -> None:
    print(f"[pfl_baseline] {message}", file=sys.stderr, flush=True)


class PflNet(nn.Module):
    """The setting's module with the ``loss`` and ``metrics`` methods pfl's ``PyTorchModel``
    calls (mean cross-entropy, as fedloom's classification loss)."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def loss(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> torch.Tensor:
        self.eval() if eval else self.train()
        return F.cross_entropy(self(x), y)

    def metrics(self, x: torch.Tensor, y: torch.Tensor, eval: bool = False) -> dict[str, Any]:
        from pfl.metrics import Weighted

        self.eval() if eval else self.train()
        with torch.no_grad():
            loss = F.cross_entropy(self(x), y, reduction="sum").item()
        return {"loss": Weighted(loss, len(x))}


def run_pfl(
    setting: peer_settings.PeerSetting, arrays: peer_settings.Arrays, rounds: int
) -> list[float]:
    """pfl's FedAvg on ``arrays`` for ``rounds`` rounds; the seconds of each round."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.data.sampling import get_user_sampler
    from pfl.hyperparam import NNEvalHyperParams, NNTrainHyperParams
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    net = PflNet(setting.model())
    model = PyTorchModel(
        model=net,
        local_optimizer_create=torch.optim.SGD,
        central_optimizer=torch.optim.SGD(net.parameters(), lr=1.0),
    )
    user_ids = list(range(setting.clients))
    dataset = FederatedDataset(
        make_dataset_fn=lambda uid: Dataset(raw_data=list(arrays[uid]), user_id=uid),
        user_sampler=get_user_sampler("minimize_reuse", user_ids),
    )
    marks: list[float] = []

    class Clock(TrainingProcessCallback):
        def on_train_begin(self, *, model: Any) -> Any:
            marks.append(time.perf_counter())
            return Metrics()

        def after_central_iteration(
            self, aggregate_metrics: Any, model: Any, *, central_iteration: int
        ) -> Any:
            marks.append(time.perf_counter())
            return False, Metrics()

    FederatedAveraging().run(
        algorithm_params=NNAlgorithmParams(
            central_num_iterations=rounds,
            evaluation_frequency=rounds + 1,
            train_cohort_size=setting.per_round,
            val_cohort_size=0,
        ),
        backend=SimulatedBackend(training_data=dataset, val_data=None),
        model=model,
        model_train_params=NNTrainHyperParams(
            local_learning_rate=setting.lr,
            local_num_epochs=setting.epochs,
            local_batch_size=setting.batch_size,
        ),
        model_eval_params=NNEvalHyperParams(local_batch_size=setting.batch_size),
        callbacks=[Clock()],
        send_metrics_to_platform=False,
    )
    return [b - a for a, b in itertools.pairwise(marks)]


def run_fedloom(bench: roofline.Bench, executor: str, rounds: int) -> tuple[list[float], str]:
    """fedloom on the same arrays: ``rounds`` rounds of ``Engine.train_round``."""
    runner = roofline.Runner(bench, executor)
    try:
        return [runner.round() for _ in range(rounds)], runner.choice()
    finally:
        runner.close()


def compare(
    name: str, executors: list[str], rounds: int, repeats: int, quick: bool
) -> dict[str, Any]:
    setting = peer_settings.SETTINGS[name]
    bench = roofline.peer_bench(setting, quick)
    if quick:
        setting = peer_settings.shrink(
            setting, 100, setting.samples, min(setting.per_round, roofline.QUICK_CLIENTS)
        )
    arrays = [(c.x_train, c.y_train) for c in bench.fed.clients]
    times: dict[str, list[float]] = {"pfl": [], **{e: [] for e in executors}}
    choices: dict[str, str] = {}
    errors: dict[str, str] = {}
    for r in range(repeats):
        rt = run_pfl(setting, arrays, rounds + 1)
        times["pfl"] += rt[1:]
        log(f"{name} repeat {r + 1}: pfl {[round(t, 3) for t in rt]}")
        for e in executors:
            if e in errors:
                continue
            try:
                ft, choices[e] = run_fedloom(bench, e, rounds + 1)
            except Exception as exc:
                errors[e] = str(exc).strip().splitlines()[0]
                log(f"{name} {e}: refused: {errors[e]}")
                continue
            times[e] += ft[1:]
            log(f"{name} repeat {r + 1}: fedloom {e} {[round(t, 3) for t in ft]}")
    pfl_s = statistics.median(times["pfl"])
    sides: dict[str, Any] = {"pfl": {"s_per_round": pfl_s, "rounds_s": times["pfl"]}}
    for e in executors:
        if e in errors:
            sides[e] = {"refused": errors[e]}
            continue
        s = statistics.median(times[e])
        sides[e] = {
            "s_per_round": s,
            "rounds_s": times[e],
            "choice": choices[e],
            "pfl_over_fedloom": pfl_s / s,
        }
    return {
        "note": bench.note,
        "per_round": setting.per_round,
        "clients": setting.clients,
        "sides": sides,
    }


def format_table(results: dict[str, Any]) -> str:
    lines = [
        f"{'setting':<13}{'side':<22}{'s/round':>9}{'pfl/x':>8}  picked / note",
        "-" * 72,
    ]
    for name, entry in results["settings"].items():
        for side, e in entry["sides"].items():
            label = f"pfl {PFL_VERSION}" if side == "pfl" else f"fedloom {side}"
            if "refused" in e:
                lines.append(f"{name:<13}{label:<22}{'refused':>9}{'':>8}  {e['refused'][:60]}")
                continue
            ratio = f"{e['pfl_over_fedloom']:.2f}x" if "pfl_over_fedloom" in e else ""
            choice = e.get("choice", "")
            lines.append(
                f"{name:<13}{label:<22}{e['s_per_round']:>9.4f}{ratio:>8}  "
                f"{choice if choice != side else ''}"
            )
        lines.append(f"{'':<13}{entry['note']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--settings", default=",".join(peer_settings.SETTINGS))
    parser.add_argument("--executors", default="auto,sequential")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds per repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="100 clients, at most 10 a round")
    parser.add_argument("--json", dest="json_out", default=None)
    parser.add_argument(
        "--omp-spin",
        action="store_true",
        help="both sides under libgomp's default spinning (GOMP_SPINCOUNT=300000) instead of "
        "fedloom's OMP_WAIT_POLICY=PASSIVE",
    )
    args = parser.parse_args(argv)
    if importlib.util.find_spec("pfl") is None:
        print(MISSING, file=sys.stderr)
        return 2
    names = [n.strip() for n in args.settings.split(",") if n.strip()]
    for n in names:
        if n not in peer_settings.SETTINGS:
            parser.error(f"--settings: unknown {n!r}; allowed: {', '.join(peer_settings.SETTINGS)}")
    executors = [e.strip() for e in args.executors.split(",") if e.strip()]
    for e in executors:
        roofline.parse_executor(e)
    from importlib.metadata import version

    results = {
        "pfl_version": version("pfl"),
        "torch_threads": torch.get_num_threads(),
        "openmp_wait": {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")},
        "settings": {
            n: compare(n, executors, max(1, args.rounds), max(1, args.repeats), args.quick)
            for n in names
        },
        "load_average": os.getloadavg(),
    }
    print(format_table(results))
    if args.json_out:
        with open(args.json_out, "w") as fh:
            fh.write(json.dumps(results, indent=1) + "\n")
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
