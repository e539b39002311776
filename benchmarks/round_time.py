"""Seconds per round: fedloom's executors against a reference written the way common FL
libraries write it (``reference.py`` for FedAvg, ``reference_pfl.py`` for the personalized
workloads), all measured in one process and reported as ratios.

Usage: ``python benchmarks/round_time.py [--workloads W1,W2,W3|pfl|W1-pfl|W3-pfl|W3-ditto,...]
[--repeats N] [--quick] [--device cuda]``. The last line of stdout is one JSON object keyed by
workload; see benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from reference import fedavg_round
from reference_pfl import PFLReference, build_reference
from torch import nn

from fedloom.config import parse_config
from fedloom.data.federated import FederatedData, from_arrays
from fedloom.engine.loop import Engine, setup_frozen
from fedloom.engine.state import RunState
from fedloom.engine.threads import macs_per_sample, torch_threads
from fedloom.models import MLP, build_model

SEED = 0
INPUT_SHAPE = (1, 28, 28)
NUM_CLASSES = 10
CPU = torch.device("cpu")
THREAD_COUNTS = (1, 2)
PRUNE_FACTOR = 3.0
PRUNE_MIN_EXCESS_S = 5.0
"""...and at least this much slower: the first contender of a family pays one-off costs."""
FAMILIES = ("sequential", "vectorized")


FEDAVG = {"name": "fedavg"}


@dataclass(frozen=True)
class Workload:
    """One benchmark setting: an algorithm (FedAvg for W1-W3), every client participates,
    synthetic MNIST-shaped data."""

    name: str
    model: str
    clients: int
    samples: int
    batch_size: int
    epochs: int = 1
    lr: float = 0.05
    test_samples: int = 100
    repeats: int = 5
    warmup_clients: int | None = None
    """Clients in the untimed warm-up round (None: all of them)."""
    note: str = ""
    algorithm: dict[str, Any] = field(default_factory=lambda: dict(FEDAVG))
    """fedloom's ``algorithm`` config; the reference runs the same algorithm and options."""
    hidden: int | None = None
    """Hidden units of the ``mlp`` (None: the model's default, 200)."""
    grad_passes: float = 1.0
    """Forward+backward passes per minibatch relative to FedAvg (for the FLOP estimate)."""
    evaluation: bool = True
    """Measure the per-client evaluation (``measure_evaluation``) after the rounds."""

    @property
    def personalized(self) -> bool:
        return self.algorithm["name"] != FEDAVG["name"]


WORKLOADS: dict[str, Workload] = {
    "W1": Workload("W1", "mlp", 100, 600, 32, test_samples=100, warmup_clients=20),
    "W2": Workload("W2", "cnn", 100, 600, 32, test_samples=100, repeats=1, warmup_clients=4),
    "W3": Workload("W3", "logreg", 1000, 60, 10, test_samples=10, warmup_clients=200),
}

PFL_ALGORITHMS: dict[str, tuple[dict[str, Any], float]] = {
    "ditto": ({"name": "ditto", "mu": 0.1}, 2.0),
    "pfedme": ({"name": "pfedme", "lam": 15.0, "inner_steps": 5, "inner_lr": 0.09}, 5.0),
    "apfl": ({"name": "apfl", "alpha": 0.25}, 2.0),
    "perfedavg": ({"name": "perfedavg", "variant": "fo", "alpha": 0.01}, 2.0),
    "fedrep": ({"name": "fedrep", "head_epochs": 1}, 2.0),
}
"""The personalized workloads' algorithm configs (the reference gets the same options) and
their gradient passes per minibatch relative to FedAvg (pFedMe: K = 5 prox steps)."""
FEDREP_W3_HIDDEN = 16


def pfl_workloads() -> dict[str, Workload]:
    """W1-<algorithm> and W3-<algorithm>: the shapes of W1 and W3 with a personalized
    algorithm; W3-fedrep needs a body, so it trains a 2NN with 16 hidden units."""
    out: dict[str, Workload] = {}
    for shape in ("W1", "W3"):
        base = WORKLOADS[shape]
        for algo, (config, passes) in PFL_ALGORITHMS.items():
            wl = replace(
                base,
                name=f"{shape}-{algo}",
                algorithm=dict(config),
                grad_passes=passes,
                evaluation=False,
            )
            if shape == "W3" and algo == "fedrep":
                wl = replace(
                    wl,
                    model="mlp",
                    hidden=FEDREP_W3_HIDDEN,
                    note=f"FedRep needs a body: a 2NN with {FEDREP_W3_HIDDEN} hidden units "
                    "(MLP(hidden=16)) instead of logistic regression, in fedloom and the reference",
                )
            out[wl.name] = wl
    return out


PFL_WORKLOADS = pfl_workloads()
ALL_WORKLOADS = {**WORKLOADS, **PFL_WORKLOADS}

GROUPS: dict[str, list[str]] = {
    "PFL": list(PFL_WORKLOADS),
    "W1-PFL": [n for n in PFL_WORKLOADS if n.startswith("W1-")],
    "W3-PFL": [n for n in PFL_WORKLOADS if n.startswith("W3-")],
}
"""``--workloads`` names that stand for several workloads (matched case-insensitively)."""

TARGETS: dict[str, dict[str, float]] = {
    "W1": {"reference/auto": 2.5, "reference/sequential": 1.4},
    "W2": {"reference/auto": 1.2},
    "W3": {"reference/auto": 15.0, "reference/sequential": 3.0},
    **{n: {"reference/auto": 2.0, "sequential/auto": 0.95} for n in GROUPS["W1-PFL"]},
    **{n: {"reference/auto": 8.0, "sequential/auto": 0.95} for n in GROUPS["W3-PFL"]},
}
"""Speed-up targets of the issue: reference seconds over fedloom seconds, same run
(``sequential/auto`` >= 0.95: auto never more than 5 % slower than the sequential executor)."""


def select_workloads(spec: str) -> list[Workload]:
    """The workloads named in the comma-separated ``spec`` (names or GROUPS, any case)."""
    by_upper = {n.upper(): n for n in ALL_WORKLOADS}
    names: list[str] = []
    for raw in spec.split(","):
        key = raw.strip().upper()
        if key in GROUPS:
            names += GROUPS[key]
        elif key in by_upper:
            names.append(by_upper[key])
        else:
            allowed = ", ".join([*ALL_WORKLOADS, *(g.lower() for g in GROUPS)])
            raise ValueError(f"--workloads: unknown workload {raw.strip()!r}; allowed: {allowed}")
    return [ALL_WORKLOADS[n] for n in dict.fromkeys(names)]


def make_module(wl: Workload) -> nn.Module:
    """The workload's model (``hidden``: a 2NN of that width)."""
    if wl.hidden is not None:
        if wl.model != "mlp":
            raise ValueError(f"workload {wl.name}: hidden applies to model mlp, not {wl.model}")
        return MLP(INPUT_SHAPE, NUM_CLASSES, hidden=wl.hidden)
    return build_model(wl.model, INPUT_SHAPE, NUM_CLASSES)


def log(msg: str) -> None:
    """Progress goes to stderr so that stdout ends with the JSON line."""
    print(msg, file=sys.stderr, flush=True)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU runs asynchronously; the CPU does not)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def threads(n: int | None) -> AbstractContextManager[None]:
    """Run the block with ``n`` intra-op threads (None: all cores)."""
    return torch_threads(n or os.cpu_count() or 1)


# -- data -------------------------------------------------------------------------------------
@dataclass
class BenchData:
    """A workload's data both as fedloom's FederatedData and as plain per-client tensors."""

    workload: Workload
    fed: FederatedData
    train: list[tuple[torch.Tensor, torch.Tensor]]
    probe: tuple[torch.Tensor, torch.Tensor]
    """Pooled training samples of the first clients, for the sanity check's loss."""


def make_data(wl: Workload, seed: int = SEED) -> BenchData:
    """Random float32 images in [0, 1) with labels from a fixed random linear teacher (so that
    one round of training visibly lowers the loss, which the sanity check relies on)."""
    gen = torch.Generator().manual_seed(seed)
    dim = math.prod(INPUT_SHAPE)
    teacher = torch.randn(dim, NUM_CLASSES, generator=gen)

    def draw(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.rand(n, *INPUT_SHAPE, generator=gen)
        y = ((x.reshape(n, -1) - 0.5) @ teacher).argmax(dim=1)
        return x, y

    train = [draw(wl.samples) for _ in range(wl.clients)]
    test = [draw(wl.test_samples) for _ in range(wl.clients)]
    fed = from_arrays(train=train, test=test, name=f"synthetic-{wl.name}")
    pooled = train[: max(1, 3000 // wl.samples)]
    probe = (torch.cat([x for x, _ in pooled]), torch.cat([y for _, y in pooled]))
    return BenchData(wl, fed, train, probe)


# -- contenders ---------------------------------------------------------------------------------
class Contender:
    """Something that runs one FedAvg round; ``round`` returns its wall seconds."""

    label: str
    threads: int | None

    def warmup(self) -> float:
        raise NotImplementedError

    def round(self) -> float:
        raise NotImplementedError

    def global_state(self) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def describe(self) -> str:
        return self.label


class ReferenceContender(Contender):
    """The reference round of ``reference.py`` (FedAvg) or ``reference_pfl.py`` (the
    workload's personalized algorithm) at a fixed intra-op thread count."""

    def __init__(
        self,
        data: BenchData,
        init: dict[str, torch.Tensor],
        n_threads: int,
        device: torch.device = CPU,
    ) -> None:
        self.data = data
        self.threads = n_threads
        self.device = device
        self.label = f"reference/threads={n_threads}"
        wl = data.workload
        self.model = make_module(wl)
        self.model.load_state_dict(init)
        self.model.to(device)
        self.pfl = self._pfl(self.model)
        self.rounds = 0

    def _pfl(self, model: nn.Module) -> PFLReference | None:
        """The personalized reference over ``model`` with fresh per-client objects."""
        wl = self.data.workload
        if not wl.personalized:
            return None
        device = None if self.device.type == "cpu" else self.device
        return build_reference(wl.algorithm, model, wl.lr, wl.batch_size, wl.epochs, device)

    def _round(
        self,
        model: nn.Module,
        pfl: PFLReference | None,
        clients: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> float:
        wl = self.data.workload
        device = None if self.device.type == "cpu" else self.device
        with threads(self.threads):
            sync(self.device)
            start = time.perf_counter()
            if pfl is None:
                fedavg_round(
                    model, clients, wl.lr, wl.batch_size, wl.epochs, SEED + self.rounds, device
                )
            else:
                pfl.round(clients, SEED + self.rounds)
            sync(self.device)
            return time.perf_counter() - start

    def warmup(self) -> float:
        """An untimed round on ``warmup_clients`` clients, on copies (the model and the
        personal objects of the timed rounds stay untouched)."""
        k = self.data.workload.warmup_clients
        model = copy.deepcopy(self.model)
        return self._round(model, self._pfl(model), self.data.train[:k])

    def round(self) -> float:
        self.rounds += 1
        return self._round(self.model, self.pfl, self.data.train)

    def global_state(self) -> dict[str, torch.Tensor]:
        state = self.model.state_dict()
        keys = self.pfl.uploaded_keys() if self.pfl is not None else list(state)
        return {k: state[k].detach().cpu().clone() for k in keys}


class EngineContender(Contender):
    """fedloom's Engine with one executor kind; times ``engine.train_round`` (sampling, plans,
    client work, aggregation; no evaluation)."""

    def __init__(
        self,
        data: BenchData,
        kind: str,
        n_threads: int | None,
        chunk_size: int | None = None,
        device: torch.device = CPU,
    ) -> None:
        wl = data.workload
        self.data = data
        self.kind = kind
        self.threads = n_threads
        # the sequential executor runs on the CPU only: on a GPU machine it is the CPU baseline
        self.device = CPU if kind == "sequential" else device
        self.label = f"{kind}/threads={n_threads or 'all'}"
        cfg = parse_config(
            {
                "seed": SEED,
                "model": {"name": wl.model},
                "algorithm": dict(wl.algorithm),
                "train": {
                    "rounds": 1,
                    "local_epochs": wl.epochs,
                    "batch_size": wl.batch_size,
                    "lr": wl.lr,
                },
                "eval": {"every": 1},
                "checkpoint": {"every": None},
                "executor": {
                    "kind": kind,
                    "threads": n_threads,
                    "chunk_size": chunk_size,
                    "device": self.device.type,
                },
            }
        )
        self.engine = Engine(cfg, data.fed, make_module(wl))
        with threads(n_threads):
            self.engine.executor.prepare(dict(enumerate(data.fed.clients)))
        self.st = self.engine.initial_state()
        self.rounds = 0
        self.times: list[float] = []

    def warmup(self) -> float:
        """An untimed round (on ``warmup_clients`` clients) that leaves the state unchanged.
        Auto decides first, on the timed rounds' shape (every client), as a run's first round
        does: deciding on the warm-up's few clients would keep a choice made for another
        shape."""
        engine, k = self.engine, self.data.workload.warmup_clients
        executor = engine.executor
        if executor.name == "auto" and getattr(executor, "choice", "") is None:
            tasks = engine.tasks_for_round(1, engine.train_ids)
            message = engine.algorithm.server_message(self.st.server)
            executor.choice = executor.choose(engine.algorithm, message, tasks)
        with threads(self.threads):
            start = time.perf_counter()
            if k is None:  # a throwaway copy of the state
                engine.train_round(0, RunState(self.st.server, engine.new_store()))
            else:
                ids = engine.train_ids[:k]
                tasks = engine.tasks_for_round(0, ids)
                states = [engine.algorithm.init_client_state(self.st.server, c) for c in ids]
                message = engine.algorithm.server_message(self.st.server)
                engine.executor.run_round(engine.algorithm, message, tasks, states)
            return time.perf_counter() - start

    def round(self) -> float:
        self.rounds += 1
        with threads(self.threads):
            start = time.perf_counter()
            self.engine.train_round(self.rounds, self.st)  # moves self.st to the round's end
            sync(self.device)
            elapsed = time.perf_counter() - start
        self.times.append(elapsed)
        return elapsed

    @property
    def last(self) -> float:
        """Median of the timed rounds so far."""
        return statistics.median(self.times) if self.times else math.inf

    def initial_state(self) -> dict[str, torch.Tensor]:
        """The whole initial model (every key, a FedRep head too), as the engine starts."""
        params, buffers = self.engine.model.initial_state(self.engine.config.seed)
        return {k: v.detach().clone() for k, v in {**params, **buffers}.items()}

    def global_state(self) -> dict[str, torch.Tensor]:
        """What the server averages: the global model, or (no global model: FedRep) the
        shared part it keeps."""
        algorithm, server = self.engine.algorithm, self.st.server
        model = algorithm.global_model(server) if algorithm.capabilities.has_global_model else None
        if model is None:
            model = (server["params"], server["buffers"])
        return {k: v.detach().clone() for k, v in {**model[0], **model[1]}.items()}

    def describe(self) -> str:
        executor = self.engine.executor
        choice = getattr(executor, "choice", None)
        text = str(choice) if choice else self.label
        chunk = getattr(getattr(executor, "vectorized", executor), "last_chunk_size", None)
        if chunk and "vectorized" in text:
            text += f"/chunk={chunk}"
        return text

    def evaluate_models(self, models: list[tuple[dict[str, torch.Tensor], Any]]) -> float:
        """Seconds for the executor to evaluate one model per client on its test data."""
        engine = self.engine
        batch = engine.config.eval.batch_size
        with threads(self.threads):
            start = time.perf_counter()
            if hasattr(engine.executor, "evaluate"):
                engine.executor.evaluate(models, engine.data.clients, batch)
            else:  # older executors: the engine evaluated client by client
                for (p, b), d in zip(models, engine.data.clients, strict=True):
                    engine.model.evaluate(p, b, d.x_test, d.y_test, batch)
            return time.perf_counter() - start

    def evaluate(self) -> float:
        """Seconds of the engine's evaluation of every client (global and deployed models)."""
        with threads(self.threads):
            start = time.perf_counter()
            self.engine.evaluation.evaluate(self.engine.context(), self.st, self.rounds)
            return time.perf_counter() - start


# -- FLOPs and peak -------------------------------------------------------------------------------
def round_flops(wl: Workload) -> float:
    """FLOPs of one round: ~6 x MACs per sample (forward 2, backward 4) x samples x epochs
    (x ``grad_passes`` for the personalized algorithms: an estimate)."""
    macs = macs_per_sample(make_module(wl), torch.zeros(INPUT_SHAPE))
    return 6.0 * macs * wl.clients * wl.samples * wl.epochs * wl.grad_passes


def matmul_peak(size: int = 2048, repeats: int = 9, device: torch.device = CPU) -> float:
    """Float32 ``torch.mm`` FLOP/s of size x size matrices on all cores (or the GPU): the
    fastest of ``repeats`` (a ceiling, so the best observation, not the median, estimates
    it)."""
    gen = torch.Generator().manual_seed(SEED)
    a = torch.randn(size, size, generator=gen).to(device)
    b = torch.randn(size, size, generator=gen).to(device)
    out = torch.empty(size, size, device=device)
    times = []
    with threads(None):
        torch.mm(a, b, out=out)
        for _ in range(repeats):
            sync(device)
            start = time.perf_counter()
            torch.mm(a, b, out=out)
            sync(device)
            times.append(time.perf_counter() - start)
    return 2.0 * size**3 / min(times)


# -- the measurement ------------------------------------------------------------------------
def probe_loss(wl: Workload, state: dict[str, torch.Tensor], probe: tuple[Any, Any]) -> float:
    module = make_module(wl)
    module.load_state_dict(state)
    module.eval()
    with torch.no_grad():
        return float(F.cross_entropy(module(probe[0]), probe[1]))


def best_of(results: dict[str, list[float]], prefix: str) -> tuple[str, float] | None:
    """The fastest contender (by median) whose label starts with ``prefix``."""
    found = [(k, statistics.median(v)) for k, v in results.items() if k.startswith(prefix) and v]
    return min(found, key=lambda kv: kv[1]) if found else None


def measure_workload(
    wl: Workload,
    peak: float,
    repeats: int | None = None,
    eval_too: bool = True,
    device: torch.device = CPU,
    thread_counts: tuple[int, ...] = THREAD_COUNTS,
) -> dict[str, Any]:
    """Time every contender on ``wl`` (warm-up, then repeats interleaved across contenders so
    that background load hits all of them alike) and return the workload's JSON entry."""
    repeats = repeats or wl.repeats
    algorithm = "" if not wl.personalized else f", algorithm {wl.algorithm}"
    log(f"[{wl.name}] {wl.clients} clients x {wl.samples} samples, model {wl.model}{algorithm}")
    data = make_data(wl)
    contenders: list[Contender] = []
    for kind in ("sequential", "vectorized"):
        contenders += [EngineContender(data, kind, t, device=device) for t in thread_counts]
    init = contenders[0].initial_state()  # type: ignore[attr-defined]
    contenders += [ReferenceContender(data, init, t, device) for t in thread_counts]
    auto_error = None
    try:
        contenders.append(EngineContender(data, "auto", None, device=device))
    except Exception as err:  # no auto executor in this checkout: fall back, say so
        auto_error = f"{type(err).__name__}: {err}"
        log(f"[{wl.name}] executor.kind auto unavailable ({auto_error}); falling back")

    warm: dict[str, float] = {}
    for c in contenders:
        warm[c.label] = c.warmup()
        log(f"[{wl.name}] warm-up {c.label}: {warm[c.label]:.3f} s")
    pruned = prune(warm, PRUNE_FACTOR)
    if pruned:
        log(f"[{wl.name}] not timed (warm-up > {PRUNE_FACTOR}x its other thread count): {pruned}")
    timed = [c for c in contenders if c.label not in pruned]
    times: dict[str, list[float]] = {c.label: [] for c in timed}
    after_first: dict[str, dict[str, torch.Tensor]] = {}
    # as Engine.run does, for every contender alike: the set-up objects (data, models, about
    # 300k for W3) are not rescanned by full garbage collections inside the timed rounds
    with setup_frozen():
        for r in range(repeats):
            for c in timed:
                times[c.label].append(c.round())
                log(f"[{wl.name}] round {r + 1}/{repeats} {c.label}: {times[c.label][-1]:.3f} s")
                if r == 0:
                    after_first[c.label] = c.global_state()
    sanity = check_sanity(wl, init, after_first, data.probe)
    log(f"[{wl.name}] sanity: {sanity}")
    first_seq, first_vec = (next(c for c in timed if c.label.startswith(k)) for k in FAMILIES)
    seq_vec = max_abs_diff(first_seq.global_state(), first_vec.global_state())

    ref = best_of(times, "reference")
    seq = best_of(times, "sequential")
    vec = best_of(times, "vectorized")
    assert ref and seq and vec
    auto_c = next((c for c in contenders if c.label.startswith("auto")), None)
    if auto_c is not None:
        best_s = statistics.median(times[auto_c.label])
        best_config = f"auto -> {auto_c.describe()}"
    else:
        label, best_s = min((seq, vec), key=lambda kv: kv[1])
        best_config = f"FALLBACK (no auto executor): best measured = {label}"
    flops = round_flops(wl)
    achieved = flops / best_s
    entry: dict[str, Any] = {
        "device": device.type,
        "reference_s": ref[1],
        "sequential_s": seq[1],
        "vectorized_s": vec[1],
        "best_s": best_s,
        "best_config": best_config,
        "peak_fraction": achieved / peak,
        "reference_threads": int(ref[0].split("=")[1]),
        "sequential_threads": int(seq[0].split("=")[1]),
        "vectorized_threads": int(vec[0].split("=")[1]),
        "vectorized_chunk": next((c.describe() for c in contenders if c.label == vec[0]), vec[0]),
        "ratio_reference_over_best": ref[1] / best_s,
        "ratio_reference_over_sequential": ref[1] / seq[1],
        "ratio_reference_over_vectorized": ref[1] / vec[1],
        "round_gflop": flops / 1e9,
        "achieved_gflops": achieved / 1e9,
        "peak_gflops": peak / 1e9,
        "repeats": repeats,
        "clients": wl.clients,
        "samples_per_client": wl.samples,
        "all_medians_s": {k: statistics.median(v) for k, v in times.items()},
        "warmup_s": warm,
        "not_timed": pruned,
        "sanity": sanity,
        "sequential_vs_vectorized_max_abs_diff": seq_vec,
    }
    if wl.personalized:
        entry["algorithm"] = dict(wl.algorithm)
        entry["ratio_sequential_over_best"] = seq[1] / best_s
    if auto_error:
        entry["auto_error"] = auto_error
    if wl.note:
        entry["note"] = wl.note
    entry["targets"] = {
        name: {"target": t, "ratio": entry[_ratio_key(name)], "met": entry[_ratio_key(name)] >= t}
        for name, t in TARGETS.get(wl.name, {}).items()
    }
    if eval_too and wl.evaluation:
        entry["evaluation"] = measure_evaluation(contenders)
    return entry


def prune(warm: dict[str, float], factor: float) -> list[str]:
    """Labels whose warm-up took over ``factor`` times the fastest warm-up of the same
    implementation at another thread count and over PRUNE_MIN_EXCESS_S slower (under
    background load two threads on two cores can be 10x slower; timing them further only
    costs minutes). ``auto`` is always timed."""
    out = []
    for label, seconds in warm.items():
        family = label.split("/")[0]
        if family == "auto":
            continue
        best = min(v for k, v in warm.items() if k.split("/")[0] == family)
        if seconds > factor * best and seconds - best > PRUNE_MIN_EXCESS_S:
            out.append(label)
    return out


def check_sanity(
    wl: Workload,
    init: dict[str, torch.Tensor],
    after: dict[str, dict[str, torch.Tensor]],
    probe: tuple[torch.Tensor, torch.Tensor],
) -> dict[str, Any]:
    """Did every contender's first round (from the same initial model) train the same thing?

    Batch orders differ between fedloom and the reference, so models are not equal; but the
    round's update (after - initial) of what the server averages (the global model; FedRep:
    the body) should point the same way (cosine), have about the same length, and, where the
    server holds a whole model, lower the loss on pooled training samples."""
    refs = [v for k, v in after.items() if k.startswith("reference")]
    keys = [k for k in init if all(k in state for state in after.values())]
    ref = {k: torch.stack([r[k].float() for r in refs]).mean(0) for k in keys}
    whole = len(keys) == len(init)
    initial = probe_loss(wl, init, probe) if whole else None

    def delta(state: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.cat([(state[k].float() - init[k].float()).reshape(-1) for k in keys])

    d_ref = delta(ref)
    rows: dict[str, Any] = {}
    ok = True
    for label, state in after.items():
        d = delta(state)
        cos = float(F.cosine_similarity(d, d_ref, dim=0))
        norm = float(d.norm() / d_ref.norm().clamp_min(1e-12))
        good = cos > 0.9 and 0.8 < norm < 1.25
        loss = None
        if initial is not None:
            loss = probe_loss(wl, {k: state[k] for k in keys}, probe)
            good = good and loss < initial
            loss = round(loss, 4)
        ok = ok and good
        rows[label] = {"loss": loss, "cos": round(cos, 4), "norm_ratio": round(norm, 4)}
    out: dict[str, Any] = {
        "initial_loss": None if initial is None else round(initial, 4),
        "after_round_1": rows,
        "ok": ok,
    }
    if not whole:
        out["compared"] = "the averaged part only: " + ", ".join(keys)
    return out


def _ratio_key(target: str) -> str:
    if target == "sequential/auto":
        return "ratio_sequential_over_best"
    if target.endswith("auto"):
        return "ratio_reference_over_best"
    return "ratio_reference_over_sequential"


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def measure_evaluation(contenders: list[Contender]) -> dict[str, Any]:
    """Evaluation of every client, at each executor's fastest training thread count.

    ``global_eval_s``: ``Engine.evaluate`` as FedAvg runs it (the global model on every client;
    FedAvg deploys the global model, so this path does not touch the executor and is timed
    once). ``<kind>_personalized_eval_s``: ``executor.evaluate`` of one distinct model per
    client (perturbed copies of the global model, as a personalized algorithm deploys), the
    path where executors differ; falls back to a per-client loop where an executor has none.
    """
    engines = [
        c
        for c in contenders
        if isinstance(c, EngineContender) and c.kind in FAMILIES and c.rounds > 0
    ]
    fastest = {
        kind: min((c for c in engines if c.kind == kind), key=lambda c: c.last) for kind in FAMILIES
    }
    out: dict[str, Any] = {"global_eval_s": min(fastest["sequential"].evaluate() for _ in range(2))}
    c0 = fastest["sequential"]
    params, buffers = c0.engine.algorithm.global_model(c0.st.server) or ({}, {})
    gen = torch.Generator().manual_seed(SEED)
    models = [
        ({k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in params.items()}, buffers)
        for _ in c0.engine.data.clients
    ]
    for kind, c in fastest.items():
        out[f"{kind}_personalized_eval_s"] = min(c.evaluate_models(models) for _ in range(2))
        out[f"{kind}_eval_threads"] = c.threads
    del models
    return out


# -- reporting ------------------------------------------------------------------------------
def format_table(results: dict[str, dict[str, Any]]) -> str:
    """The human-readable table (rows: workloads)."""
    w = max([4, *(len(name) for name in results)])
    head = (
        f"{'':{w}} {'reference s':>14} {'sequential s':>14} {'vectorized s':>14} "
        f"{'auto/best s':>12} {'ref/best':>9} {'ref/seq':>8} {'GFLOP/s':>8} {'peak':>6}"
    )
    lines = [head, "-" * len(head)]
    for name, e in results.items():
        lines.append(
            f"{name:{w}} "
            f"{e['reference_s']:>9.3f} (t{e['reference_threads']}) "
            f"{e['sequential_s']:>9.3f} (t{e['sequential_threads']}) "
            f"{e['vectorized_s']:>9.3f} (t{e['vectorized_threads']}) "
            f"{e['best_s']:>12.3f} {e['ratio_reference_over_best']:>8.2f}x "
            f"{e['ratio_reference_over_sequential']:>7.2f}x "
            f"{e['achieved_gflops']:>8.1f} {e['peak_fraction']:>6.1%}"
        )
    lines.append("")
    for name, e in results.items():
        lines.append(f"{name} auto/best config: {e['best_config']}")
    lines.append("")
    lines.append("Targets (seconds of the first named over seconds of the second, same run):")
    for name, e in results.items():
        for target, t in e["targets"].items():
            mark = "met" if t["met"] else "NOT MET"
            lines.append(
                f"  {name} {target:22} >= {t['target']:>5.2f}x: {t['ratio']:6.2f}x  {mark}"
            )
    lines.append("")
    lines.append(
        "Evaluation of every client (s): global = Engine.evaluate under FedAvg (shared path);"
        " personalized = executor.evaluate of one model per client:"
    )
    for name, e in results.items():
        ev = e.get("evaluation")
        if ev:
            parts = ", ".join(
                f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}" for k, v in ev.items()
            )
            lines.append(f"  {name}: {parts}")
    lines.append("")
    lines.append("Sanity (probe loss after round 1 from the same initial model):")
    for name, e in results.items():
        s = e["sanity"]
        initial = "n/a" if s["initial_loss"] is None else f"{s['initial_loss']:.4f}"
        lines.append(
            f"  {name}: {'ok' if s['ok'] else 'CHECK FAILED'}; probe loss initial"
            f" {initial}; |seq - vec| max"
            f" {e['sequential_vs_vectorized_max_abs_diff']:.2e}"
        )
        if "compared" in s:
            lines.append(f"      compared: {s['compared']}")
        for label, row in s["after_round_1"].items():
            loss = "n/a" if row["loss"] is None else f"{row['loss']:.4f}"
            lines.append(
                f"      {label:22} loss {loss:>6}  cos(update, reference update)"
                f" {row['cos']:.3f}  |update|/|reference update| {row['norm_ratio']:.3f}"
            )
    for name, e in results.items():
        if e["not_timed"]:
            lines.append(f"  {name} not timed (warm-up > {PRUNE_FACTOR}x): {e['not_timed']}")
    return "\n".join(lines)


def run(
    workloads: list[Workload],
    repeats: int | None = None,
    eval_too: bool = True,
    peak_size: int = 2048,
    on_result: Callable[[str, dict[str, Any]], None] | None = None,
    device: torch.device = CPU,
    thread_counts: tuple[int, ...] = THREAD_COUNTS,
) -> dict[str, dict[str, Any]]:
    """Measure every workload and the matmul peak (before each workload and at the end, the
    highest counts: background load only lowers it); return {workload: entry}."""
    peaks: list[float] = []
    results: dict[str, dict[str, Any]] = {}
    for wl in workloads:
        peaks.append(matmul_peak(peak_size, device=device))
        log(f"float32 matmul peak ({peak_size}^2, {device}): {peaks[-1] / 1e9:.1f} GFLOP/s")
        results[wl.name] = measure_workload(wl, peaks[-1], repeats, eval_too, device, thread_counts)
        if on_result:
            on_result(wl.name, results[wl.name])
    peaks.append(matmul_peak(peak_size, device=device))
    peak = max(peaks)
    log(f"float32 matmul peak, highest of {len(peaks)}: {peak / 1e9:.1f} GFLOP/s")
    for entry in results.values():
        entry["peak_gflops"] = peak / 1e9
        entry["peak_fraction"] = entry["achieved_gflops"] * 1e9 / peak
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--workloads",
        default="W1,W2,W3",
        help="comma-separated: W1, W2, W3, W1-<algorithm>, W3-<algorithm> (algorithms: "
        f"{', '.join(PFL_ALGORITHMS)}), or the groups pfl, W1-pfl, W3-pfl",
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (W1/W3: 5)")
    parser.add_argument("--w2-repeats", type=int, default=None, help="timed W2 rounds (1)")
    parser.add_argument("--w2-clients", type=int, default=None, help="reduce W2 (default 100)")
    parser.add_argument("--quick", action="store_true", help="W2 with 10 clients, 2 repeats")
    parser.add_argument(
        "--device",
        default="cpu",
        help="cuda: the reference, vectorized and auto on the GPU (sequential stays on the CPU)",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here")
    try:
        selected = select_workloads(args.workloads)
    except ValueError as err:
        parser.error(str(err))
    chosen: list[Workload] = []
    for wl in selected:
        repeats = args.repeats or (2 if args.quick else wl.repeats)
        if wl.name == "W2":
            repeats = args.w2_repeats or (1 if args.quick else wl.repeats)
            clients = args.w2_clients or (10 if args.quick else None)
            if clients:
                wl = replace(wl, clients=clients, note=f"REDUCED W2: {clients} clients (not 100)")
        chosen.append(replace(wl, repeats=repeats))
    for wl in chosen:
        if wl.note:
            print(f"NOTE {wl.name}: {wl.note}")
    log(f"torch {torch.__version__}, {os.cpu_count()} cores, device {device}")
    results = run(chosen, device=device)
    print(format_table(results))
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
