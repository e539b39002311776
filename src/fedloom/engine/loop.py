"""The round loop: sampling, client work, message transforms, aggregation, evaluation,
metrics, checkpoints. Algorithms never re-implement any of it (DESIGN.md 2.2)."""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from fedloom.algorithms import (
    Algorithm,
    AlgorithmContext,
    ClientResult,
    ClientTask,
    build_algorithm,
)
from fedloom.algorithms.base import Message, State
from fedloom.config import RunConfig
from fedloom.core import pytree
from fedloom.core.functional import FunctionalModel
from fedloom.core.rng import generator, seed_for
from fedloom.data.federated import ClientData, FederatedData
from fedloom.engine.cold_start import adaptation_curve
from fedloom.engine.factory import make_executor
from fedloom.engine.metrics import EvalCounts, client_quantiles, pooled
from fedloom.engine.monitoring import (
    HETEROGENEITY_FILE,
    feature_js,
    gradient_dissimilarity,
    label_kl,
    update_statistics,
)
from fedloom.engine.nonfinite import screen
from fedloom.engine.progress import RoundProgress
from fedloom.engine.rundir import RunDir
from fedloom.engine.sampling import sample_clients
from fedloom.engine.state_store import ClientStateStore
from fedloom.engine.threads import run_threads, torch_threads
from fedloom.engine.tracking import Tracker, make_trackers
from fedloom.engine.workload import full_budget, straggler_steps
from fedloom.errors import ConfigError, RunDirError
from fedloom.models.base import FedModel
from fedloom.solvers.local import PlanMaker

POOLED_CLIENT = -1
"""Client id of the virtual client that holds all data (centralized training)."""

UploadTransform = Callable[[Message, int, int], Message]
"""(upload, client_id, round) -> upload: clipping, noise, masking, encryption plug in here."""

Aggregator = Callable[[list[pytree.Tree], list[float]], pytree.Tree]
"""(trees, weights) -> tree: the server's aggregation rule (robust rules plug in here)."""


@dataclass
class RunResult:
    summary: dict[str, Any]
    history: list[dict[str, Any]]
    global_params: dict[str, torch.Tensor] | None
    client_params: dict[int, dict[str, torch.Tensor]]
    run_dir: RunDir | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def pooled_client(data: FederatedData, ids: list[int]) -> ClientData:
    parts = [data.clients[i] for i in ids]
    return ClientData(
        torch.cat([c.x_train for c in parts]),
        torch.cat([c.y_train for c in parts]),
        torch.cat([c.x_test for c in parts]),
        torch.cat([c.y_test for c in parts]),
    )


class Engine:
    def __init__(
        self,
        config: RunConfig,
        data: FederatedData,
        module: FedModel,
        run_dir: RunDir | None = None,
        progress: bool = False,
        upload_transforms: list[UploadTransform] | None = None,
        aggregator: Aggregator = pytree.weighted_average,
    ) -> None:
        self.config = config
        self.data = data
        self.run_dir = run_dir
        self.progress = progress
        self.upload_transforms = list(upload_transforms or [])
        self.model = FunctionalModel(module, data.task)
        self.executor = make_executor(config.executor, self.model)
        train = config.train
        new = config.eval.new_clients
        if new >= data.num_clients:
            raise ConfigError(
                f"eval.new_clients: {new} leaves no client to train (there are {data.num_clients})"
            )
        self.train_ids = list(range(data.num_clients - new))
        self.new_ids = list(range(data.num_clients - new, data.num_clients))
        if train.clients_per_round is not None and train.clients_per_round > len(self.train_ids):
            raise ConfigError(
                f"train.clients_per_round: {train.clients_per_round} is more than the "
                f"{len(self.train_ids)} training clients (data.num_clients={data.num_clients}"
                f", eval.new_clients={new})"
            )
        ctx = AlgorithmContext(
            model=self.model,
            seed=config.seed,
            num_clients=data.num_clients,
            lr=train.lr,
            batch_size=train.batch_size,
            aggregate=aggregator,
            make_plan=PlanMaker(config.seed, train.batch_size),
            rounds=train.rounds,
            population={c: data.clients[c].num_train for c in self.train_ids},
        )
        self.algorithm: Algorithm = build_algorithm(config.algorithm, ctx)
        self._pooled = pooled_client(data, self.train_ids) if self.algorithm.pooled else None
        self._monitor_data: dict[int, ClientData] | None = None
        self._open_trackers: list[Tracker] = []

    # -- per-client work orders -----------------------------------------------------------
    def client_data(self, client_id: int) -> ClientData:
        if client_id == POOLED_CLIENT:
            assert self._pooled is not None
            return self._pooled
        return self.data.clients[client_id]

    def tasks_for_round(self, round: int, clients: list[int]) -> list[ClientTask]:
        """Work orders of the clients that report back this round (dropped stragglers, with
        ``train.straggler_mode: drop``, get none)."""
        train, seed = self.config.train, self.config.seed
        datas = [self.client_data(c) for c in clients]
        full = [
            full_budget(train, seed, round, c, d.num_train)
            for c, d in zip(clients, datas, strict=True)
        ]
        steps = straggler_steps(seed, round, clients, full, train.stragglers, train.straggler_mode)
        make_plan = self.algorithm.ctx.make_plan
        return [
            ClientTask(c, d, make_plan(d, s, "batches", round, c), train.lr, round, full=f)
            for c, d, s, f in zip(clients, datas, steps, full, strict=True)
            if s > 0
        ]

    # -- evaluation -----------------------------------------------------------------------
    def _counts(self, params: pytree.Tree, buffers: pytree.Tree, data: ClientData) -> EvalCounts:
        return EvalCounts(
            *self.model.evaluate(
                params, buffers, data.x_test, data.y_test, self.config.eval.batch_size
            )
        )

    def evaluate(
        self, server: State, states: ClientStateStore, round: int
    ) -> tuple[dict[str, Any], dict[int, pytree.Tree]]:
        classification = self.data.task == "classification"
        row: dict[str, Any] = {}
        global_model = self.algorithm.global_model(server)
        global_counts: list[EvalCounts] = []
        if global_model is not None:
            global_counts = [self._counts(*global_model, c) for c in self.data.clients]
            row["global"] = pooled(global_counts, classification)
        else:
            row["global"] = None
        deployed: dict[int, pytree.Tree] = {}
        groups = {"personalized": self.train_ids, "new_clients": self.new_ids}
        for key, ids in groups.items():
            if not ids:
                continue
            counts: list[EvalCounts | None] = []
            pending: list[tuple[int, tuple[pytree.Tree, pytree.Tree]]] = []
            for cid in ids:
                data = self.data.clients[cid]
                state = states.get(cid) if cid in states else None
                if state is None:
                    state = self.algorithm.init_client_state(server, cid)
                params, buffers = self.algorithm.deployed_model(
                    server, state, ClientTask(cid, data, [], self.config.train.lr, round)
                )
                deployed[cid] = {**params, **buffers}
                if global_model is not None and params is global_model[0]:
                    counts.append(global_counts[cid])  # deploys the global model: evaluated
                else:
                    counts.append(None)
                    pending.append((len(counts) - 1, (params, buffers)))
            if pending:
                evaluated = self.executor.evaluate(
                    [m for _, m in pending],
                    [self.data.clients[ids[i]] for i, _ in pending],
                    self.config.eval.batch_size,
                )
                for (i, _), c in zip(pending, evaluated, strict=True):
                    counts[i] = c
            done = [c for c in counts if c is not None]
            row[key] = client_quantiles(done, classification)
            if key == "personalized" and classification:
                row["client_accuracy"] = [c.accuracy if c.n else None for c in done]
        return row, deployed

    # -- monitoring (engine/monitoring.py) -------------------------------------------------
    def _heterogeneity(self) -> dict[str, Any]:
        """Each client's label KL and feature JS to the pooled data (heterogeneity.json)."""
        clients = dict(enumerate(self.data.clients))
        report: dict[str, Any] = {"feature_js": feature_js(clients)}
        if self.data.task == "classification":
            report["label_kl"] = label_kl(clients, self.data.num_outputs)
        if self.run_dir is not None:
            self.run_dir.write_json(HETEROGENEITY_FILE, report)
        return report

    def _monitor_sample(self) -> dict[int, ClientData]:
        """The fixed sample zeta^2 is measured on: up to ``monitor.clients`` training clients,
        each with up to ``monitor.gradient_samples`` of its training samples."""
        if self._monitor_data is None:
            seed, cfg = self.config.seed, self.config.monitor
            ids = list(self.train_ids)
            if len(ids) > cfg.clients:
                order = torch.randperm(len(ids), generator=generator(seed, "monitor"))
                ids = sorted(ids[i] for i in order[: cfg.clients].tolist())
            sample = {}
            for c in ids:
                data = self.data.clients[c]
                keep = torch.randperm(data.num_train, generator=generator(seed, "monitor", 0, c))
                keep = keep[: cfg.gradient_samples] if cfg.gradient_samples else keep
                sample[c] = ClientData(
                    data.x_train[keep], data.y_train[keep], data.x_test[:0], data.y_test[:0]
                )
            self._monitor_data = sample
        return self._monitor_data

    def _round_health(self, server: State, round: int, st: dict[str, Any]) -> dict[str, Any]:
        """The evaluated round's monitoring record: update statistics and zeta^2."""
        health: dict[str, Any] = st.pop("monitor", None) or {}
        model = self.algorithm.global_model(server)
        if self.config.monitor.gradient_dissimilarity and model is not None:
            tick = time.perf_counter()
            clients = self._monitor_sample()
            with self.model.random_stream(seed_for(self.config.seed, "monitor"), round, -1):
                health["zeta2"] = gradient_dissimilarity(self.model, *model, clients)
            st["monitor_seconds"] = st.get("monitor_seconds", 0.0) + time.perf_counter() - tick
        return health

    def _privacy_spent(self) -> dict[str, float] | None:
        """The privacy budget spent so far, from the first upload transform that accounts
        for one (a method ``privacy_spent() -> {'epsilon': ..., 'delta': ...}``)."""
        for transform in self.upload_transforms:
            spent = getattr(transform, "privacy_spent", None)
            if callable(spent):
                return dict(spent())
        return None

    def _trackers(self) -> list[Tracker]:
        cfg = self.config
        name = self.run_dir.path.name if self.run_dir else f"{self.algorithm.name}-{self.data.name}"
        return make_trackers(cfg, self.run_dir.path if self.run_dir else None, name)

    def cold_start(self, server: State) -> dict[str, Any]:
        """Accuracy of the held-out new clients vs fine-tuning steps (engine/cold_start.py)."""
        cfg = self.config
        lr = cfg.eval.adapt_lr or self.algorithm.adaptation_lr() or cfg.train.lr
        return adaptation_curve(
            self.algorithm,
            server,
            {c: self.data.clients[c] for c in self.new_ids},
            cfg.eval.adaptation_steps,
            lr,
            cfg.train.rounds,
            cfg.eval.batch_size,
            self.data.task == "classification",
        )

    # -- the loop -------------------------------------------------------------------------
    def _new_store(self) -> ClientStateStore:
        directory = self.run_dir.path / "state" if self.run_dir is not None else None
        slots = self.data.num_clients + (1 if self.algorithm.pooled else 0)
        return ClientStateStore(slots, self.config.state.storage, directory)

    def _initial(self) -> dict[str, Any]:
        params, buffers = self.model.initial_state(self.config.seed)
        return {
            "round": 0,
            "server": self.algorithm.init_server_state(params, buffers),
            "clients": self._new_store(),
            "history": [],
            "bytes_up": 0,
            "bytes_down": 0,
            "elapsed": 0.0,
        }

    def _threads(self) -> int | None:
        """This process's intra-op threads for the run (engine/threads.py, run_threads)."""
        biggest = max(self.data.clients, key=lambda c: c.x_train.shape[0])
        batch = self.config.train.batch_size or biggest.x_train.shape[0]
        return run_threads(self.config.executor, self.model.module, biggest.x_train[0], batch)

    def run(self, resume: bool = False) -> RunResult:
        with torch_threads(self._threads()):
            clients = dict(enumerate(self.data.clients))
            if self._pooled is not None:
                clients[POOLED_CLIENT] = self._pooled
            self.executor.prepare(clients)
            self._open_trackers = self._trackers()
            try:
                with setup_frozen():
                    return self._run(resume)
            finally:
                self.executor.close()
                for tracker in self._open_trackers:  # a run that failed: close them as such
                    tracker.close(None, failed=True)

    def _run(self, resume: bool) -> RunResult:
        cfg = self.config
        st = self._initial()
        if resume:
            assert self.run_dir is not None
            saved = self.run_dir.latest_checkpoint()
            if saved is None:
                raise RunDirError(f"{self.run_dir.path} has no checkpoint to resume from")
            st = saved
            store = self._new_store()
            store.load_state_dict(saved["clients"])
            st["clients"] = store
            self.run_dir.rewrite_metrics(st["history"])
            if st.get("executor_choice") and hasattr(self.executor, "choice"):
                self.executor.choice = st["executor_choice"]  # resume on the same executor
        history: list[dict[str, Any]] = st["history"]
        server, states = st["server"], st["clients"]
        rounds = cfg.train.rounds
        deployed: dict[int, pytree.Tree] = {}
        start = time.perf_counter() - st["elapsed"]
        first = st["round"] + 1
        monitor = cfg.monitor.enabled
        heterogeneity = self._heterogeneity() if monitor else None
        trackers = self._open_trackers
        with RoundProgress(rounds, first - 1, enabled=self.progress) as bar:
            for round in range(first, rounds + 1):
                last = round == rounds
                evaluate = round % cfg.eval.every == 0 or last
                before = st["bytes_up"], st["bytes_down"]
                tick = time.perf_counter()
                server, states, st = self._one_round(
                    round, server, states, st, monitor and evaluate
                )
                # training time alone: the update statistics' share is reported as monitoring
                round_seconds = time.perf_counter() - tick - st.get("monitor_seconds", 0.0)
                if evaluate:
                    row, deployed = self.evaluate(server, states, round)
                    if monitor:
                        row["monitor"] = self._round_health(server, round, st)
                    privacy = self._privacy_spent()
                    if privacy is not None:
                        row["privacy"] = privacy
                    row = {
                        "round": round,
                        "wall_seconds": time.perf_counter() - start,
                        "train_loss": st["train_loss"],
                        "participants": st["participants"],
                        "reported": st["reported"],
                        "dropped_nonfinite": st.get("dropped_nonfinite", 0),
                        **({"client_info": st["client_info"]} if st.get("client_info") else {}),
                        **row,
                        "communication": {
                            "bytes_up": st["bytes_up"],
                            "bytes_down": st["bytes_down"],
                            "bytes_up_round": st["bytes_up"] - before[0],
                            "bytes_down_round": st["bytes_down"] - before[1],
                        },
                        "seconds": {
                            "round": round_seconds,
                            "monitor": st.pop("monitor_seconds", 0.0),
                        },
                    }
                    history.append(row)
                    if self.run_dir:
                        self.run_dir.append_metrics(row)
                    for tracker in trackers:
                        tracker.log(row)
                    bar.show_metrics(row)
                every = cfg.checkpoint.every
                if self.run_dir and every and (round % every == 0 or last):
                    st["elapsed"] = time.perf_counter() - start
                    st["executor_choice"] = getattr(self.executor, "choice", None)
                    payload = {
                        **st,
                        "round": round,
                        "server": server,
                        "clients": states.state_dict(),
                        "history": history,
                    }
                    self.run_dir.save_checkpoint(round, payload, cfg.checkpoint.keep)
                bar.advance()
        wall = time.perf_counter() - start
        if not deployed:  # resumed at the very end: evaluate once to report client models
            _, deployed = self.evaluate(server, states, rounds)
        summary = self._summary(history, st, wall)
        if self.new_ids:
            summary["cold_start"] = self.cold_start(server)
        if heterogeneity is not None:
            summary["heterogeneity"] = heterogeneity_summary(heterogeneity, history)
        for tracker in trackers:
            tracker.close(summary)
        self._open_trackers = []
        extras = self.algorithm.summary_extras(server)
        if extras:
            summary["extras"] = extras
        global_model = self.algorithm.global_model(server)
        return RunResult(
            summary=summary,
            history=history,
            global_params={**global_model[0], **global_model[1]} if global_model else None,
            client_params=deployed,
            run_dir=self.run_dir,
            extras=extras,
        )

    def _one_round(
        self,
        round: int,
        server: State,
        states: ClientStateStore,
        st: dict[str, Any],
        monitor: bool = False,
    ) -> tuple[State, ClientStateStore, dict[str, Any]]:
        cfg = self.config
        if self.algorithm.pooled:
            clients = [POOLED_CLIENT]
        else:
            clients = sample_clients(cfg.seed, round, self.train_ids, cfg.train.clients_per_round)
        for c in clients:
            if c not in states:
                states.set(c, self.algorithm.init_client_state(server, c))
        message = self.algorithm.round_message(server, round)
        tasks = self.tasks_for_round(round, clients)
        results: list[ClientResult] = self.executor.run_round(
            self.algorithm, message, tasks, [states.get(t.client_id) for t in tasks]
        )
        screened = screen(tasks, results, round, self.algorithm.config.model_dump(), cfg.train)
        tasks, results = screened.tasks, screened.results
        st["dropped_nonfinite"] = st.get("dropped_nonfinite", 0) + len(screened.dropped)
        for task, result in zip(tasks, results, strict=True):
            for transform in self.upload_transforms:
                result.upload = transform(result.upload, task.client_id, round)
            if result.state is not None:
                states.set(task.client_id, result.state)
        if self.algorithm.communicates:
            st["bytes_down"] += sum(self.algorithm.download_bytes(message, c) for c in clients)
            st["bytes_up"] += sum(message_bytes(r.upload) for r in results)
        st["client_info"] = mean_info(results)
        if monitor:
            tick = time.perf_counter()
            deltas = {
                t.client_id: self.algorithm.client_delta(message, r)
                for t, r in zip(tasks, results, strict=True)
            }
            st["monitor"] = update_statistics(
                {c: d for c, d in deltas.items() if d is not None}, self.config.monitor.clients
            )
            st["monitor_seconds"] = time.perf_counter() - tick
        if results:  # every sampled client dropped out: the server keeps its state
            server = self.algorithm.aggregate(server, results)
        total = sum(r.weight for r in results)
        st["train_loss"] = sum(r.loss * r.weight for r in results) / total if total else None
        st["participants"] = len(clients)
        st["reported"] = len(results)
        return server, states, st

    def _summary(
        self, history: list[dict[str, Any]], st: dict[str, Any], wall: float
    ) -> dict[str, Any]:
        cfg = self.config
        last = history[-1] if history else {}
        personalized = {k: v for k, v in (last.get("personalized") or {}).items()}
        summary = {
            "algorithm": self.algorithm.name,
            "dataset": self.data.name,
            "model": cfg.model.name,
            "num_clients": self.data.num_clients,
            "rounds": cfg.train.rounds,
            "seed": cfg.seed,
            "executor": self.executor.name,
            "executor_choice": getattr(self.executor, "choice", None) or self.executor.name,
            "final": {"global": last.get("global"), "personalized": personalized},
            "communication": {
                "bytes_up": st["bytes_up"],
                "bytes_down": st["bytes_down"],
                "bytes_up_per_round": st["bytes_up"] / cfg.train.rounds,
                "bytes_down_per_round": st["bytes_down"] / cfg.train.rounds,
            },
            "wall_seconds": wall,
            "seconds_per_round": wall / cfg.train.rounds,
            "dropped_nonfinite": st.get("dropped_nonfinite", 0),
        }
        if last.get("new_clients"):
            summary["final"]["new_clients"] = last["new_clients"]
        accuracy = last.get("client_accuracy")
        if accuracy and len(accuracy) == len(self.train_ids):
            # each client's deployed (personalized) model on its own held-out data
            summary["final"]["client_accuracy"] = {
                str(c): a for c, a in zip(self.train_ids, accuracy, strict=True)
            }
        return summary


@contextmanager
def setup_frozen() -> Iterator[None]:
    """Exempt everything built so far (data, models, arenas) from the cyclic garbage
    collector for the block: its full collections otherwise scan all of it, 160 ms for W3's
    1,000 clients (300k objects), in about one round of three (a round takes 145 ms).
    ``gc.freeze`` moves the tracked objects to a permanent generation in O(1); ``unfreeze``
    hands them back, so garbage made before the run is collected after it."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def heterogeneity_summary(
    heterogeneity: dict[str, Any], history: list[dict[str, Any]]
) -> dict[str, Any]:
    """summary.json's ``heterogeneity``: mean label KL and feature JS over clients, and the
    last measured zeta^2."""

    def mean(values: dict[str, float] | None) -> float | None:
        return sum(values.values()) / len(values) if values else None

    zeta = [row["monitor"]["zeta2"] for row in history if "zeta2" in row.get("monitor", {})]
    return {
        "label_kl_mean": mean(heterogeneity.get("label_kl")),
        "feature_js_mean": mean(heterogeneity.get("feature_js")),
        "zeta2_last": zeta[-1] if zeta else None,
    }


def mean_info(results: list[ClientResult]) -> dict[str, float]:
    """Per key, the mean over the round's reports of the numbers clients put in
    ``ClientResult.info`` (e.g. pFedMac's sparsity); bookkeeping keys are skipped."""
    keys = sorted({k for r in results for k in r.info if k not in ("client", "round")})
    out = {}
    for key in keys:
        values = [float(r.info[key]) for r in results if key in r.info]
        out[key] = sum(values) / len(values)
    return out


def message_bytes(message: Message) -> int:
    return sum(pytree.num_bytes(tree) for tree in message.values())
