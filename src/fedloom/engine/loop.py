"""The round loop: sampling, client work, message transforms, aggregation, evaluation,
metrics, checkpoints. Algorithms never re-implement any of it (DESIGN.md 2.2)."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from fedloom.algorithms import ALGORITHMS, Algorithm, AlgorithmContext, ClientTask, build_algorithm
from fedloom.config import RunConfig, check_client_counts
from fedloom.core import pytree
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientResult, Message
from fedloom.data.federated import FederatedData
from fedloom.engine.callbacks import (
    Callback,
    Checkpointing,
    ColdStart,
    Evaluation,
    HealthMonitor,
    MetricsLog,
    PrivacyAccounting,
    SecureAggregationLog,
)
from fedloom.engine.dropout import dropouts, uploads
from fedloom.engine.factory import make_executor
from fedloom.engine.nonfinite import screen
from fedloom.engine.rundir import RunDir
from fedloom.engine.sampling import POOLED_CLIENT, TrainingClients
from fedloom.engine.state import RoundReport, RunState
from fedloom.engine.state_store import ClientStateStore
from fedloom.engine.threads import run_threads, torch_threads
from fedloom.engine.workload import full_budget, most_steps, straggler_steps
from fedloom.errors import ConfigError, RunDirError
from fedloom.models.base import FedModel
from fedloom.privacy import ClientLevelDP, SampleLevelDP
from fedloom.secure.aggregation import SecureAggregation, build_protocol
from fedloom.secure.base import DropStage, SecureAggregationAbort
from fedloom.solvers.local import PlanMaker

log = logging.getLogger(__name__)

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


class Engine:
    """One run: the round loop (``train_round``) and the callbacks around it."""

    def __init__(
        self,
        config: RunConfig,
        data: FederatedData,
        module: FedModel,
        run_dir: RunDir | None = None,
        progress: bool = False,
        upload_transforms: list[UploadTransform] | None = None,
        aggregator: Aggregator = pytree.weighted_average,
        callbacks: list[Callback] | None = None,
    ) -> None:
        """``callbacks`` run after the built-in evaluation, monitoring and privacy accounting
        and before the metrics log and checkpoints (engine/callbacks.py)."""
        self.config = config
        self.data = data
        self.run_dir = run_dir
        self.progress = progress
        self.upload_transforms = list(upload_transforms or [])
        self.model = FunctionalModel(module, data.task)
        self.executor = make_executor(config.executor, self.model)
        train = config.train
        if config.data.num_clients != data.num_clients:  # else checked when parsed
            check_client_counts(config, data.num_clients)
        new = config.eval.new_clients
        self.train_ids = list(range(data.num_clients - new))
        self.new_ids = list(range(data.num_clients - new, data.num_clients))
        self.privacy = self._privacy(len(self.train_ids))
        if isinstance(self.privacy, ClientLevelDP):
            aggregator = self.privacy.aggregate
            self.upload_transforms.insert(0, self.privacy.clip_upload)
        sample_dp = self.privacy if isinstance(self.privacy, SampleLevelDP) else None
        self.secure = self._secure_aggregation()
        if self.secure is not None:
            if isinstance(self.privacy, ClientLevelDP):  # the DP sum of clipped updates
                self.privacy.update_sum = self.secure.sum_updates
            else:
                aggregator = self.secure.aggregate
        ctx = AlgorithmContext(
            model=self.model,
            seed=config.seed,
            num_clients=data.num_clients,
            lr=train.lr,
            batch_size=train.batch_size,
            aggregate=aggregator,
            make_plan=PlanMaker(config.seed, train.batch_size, poisson=sample_dp is not None),
            rounds=train.rounds,
            population={c: data.clients[c].num_train for c in self.train_ids},
            sample_dp=sample_dp.dpsgd if sample_dp is not None else None,
        )
        self.algorithm: Algorithm = build_algorithm(config.algorithm, ctx)
        program = self.algorithm.client_program()
        if sample_dp is not None and getattr(program, "private", None) is None:
            raise ConfigError(  # declared, but its program has a step of its own
                f"privacy.kind: sample_dp: {self.algorithm.name}'s client program does not take "
                "DP-SGD steps"
            )
        self.training = TrainingClients.view(
            data,
            self.train_ids,
            train.clients_per_round,
            self.algorithm.pooled,
            poisson=isinstance(self.privacy, ClientLevelDP)
            and config.privacy.sampling == "poisson",
        )
        self.evaluation = Evaluation()
        self.callbacks: list[Callback] = [
            self.evaluation,
            *([HealthMonitor()] if config.monitor.enabled else []),
            PrivacyAccounting([self.privacy, *self.upload_transforms]),
            *([SecureAggregationLog(self.secure)] if self.secure is not None else []),
            *(callbacks or []),
            MetricsLog(progress),
            Checkpointing(),
            ColdStart(),
        ]

    # -- per-client work orders -----------------------------------------------------------
    def tasks_for_round(self, round: int, clients: list[int]) -> list[ClientTask]:
        """Work orders of the clients that report back this round (dropped stragglers, with
        ``train.straggler_mode: drop``, get none)."""
        train, seed = self.config.train, self.config.seed
        datas = [self.training.data[c] for c in clients]
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

    # -- the loop -------------------------------------------------------------------------
    def new_store(self) -> ClientStateStore:
        directory = self.run_dir.path / "state" if self.run_dir is not None else None
        slots = self.data.num_clients + 1  # the last slot: a pooled view's client (id -1)
        return ClientStateStore(slots, self.config.state.storage, directory)

    def initial_state(self) -> RunState:
        params, buffers = self.model.initial_state(self.config.seed)
        return RunState(self.algorithm.init_server_state(params, buffers), self.new_store())

    def resumed_state(self) -> RunState:
        """The state of the newest good checkpoint; metrics.jsonl rewritten to match it."""
        assert self.run_dir is not None
        saved = self.run_dir.latest_checkpoint()
        if saved is None:
            raise RunDirError(f"{self.run_dir.path} has no checkpoint to resume from")
        state = RunState.from_checkpoint(saved, self.new_store())
        self.run_dir.rewrite_metrics(state.history)
        if state.executor_choice and hasattr(self.executor, "choice"):
            self.executor.choice = state.executor_choice  # resume on the same executor
        if self.privacy is not None and state.privacy:
            self.privacy.load_state_dict(state.privacy)
        if self.secure is not None and state.secure:
            self.secure.load_state_dict(state.secure)
        return state

    def _secure_aggregation(self) -> SecureAggregation | None:
        """The run's secure aggregation (``secure_aggregation``), or None."""
        cfg = self.config.secure_aggregation
        if cfg.kind == "none":
            return None
        buffers = [n for n, _ in self.model.module.named_buffers()]
        if buffers:
            raise ConfigError(
                f"secure_aggregation.kind: {cfg.kind} sums one vector of parameters per client "
                f"and round; the model's buffers ({', '.join(buffers)}) would need a second sum:"
                " use a model without normalization statistics"
            )
        per_round = self.config.train.clients_per_round or len(self.train_ids)
        protocol = build_protocol(cfg, self.config.seed, max(2, per_round * 2))
        return SecureAggregation(cfg, protocol)

    def _privacy(self, num_train: int) -> ClientLevelDP | SampleLevelDP | None:
        """The run's differential-privacy mechanism (``privacy``), or None."""
        cfg = self.config
        kind = cfg.privacy.kind
        if kind == "none":
            return None
        buffers = [n for n, _ in self.model.module.named_buffers()]
        if buffers:
            raise ConfigError(
                f"privacy.kind: {kind} cannot release the model's buffers ({', '.join(buffers)})"
                " without noise: use a model without normalization statistics"
            )
        if kind == "sample_dp":
            train = cfg.train
            population = {c: self.data.clients[c].num_train for c in self.train_ids}
            if ALGORITHMS.get(cfg.algorithm.name).pooled:  # one virtual client of all data
                population = {POOLED_CLIENT: sum(population.values())}
            most = {c: most_steps(train, c, n) * train.rounds for c, n in population.items()}
            return SampleLevelDP(cfg.privacy, population, train.batch_size, most)
        assert cfg.train.clients_per_round is not None  # checked when parsed
        return ClientLevelDP(
            cfg.privacy, cfg.seed, num_train, cfg.train.clients_per_round, cfg.train.rounds
        )

    def _threads(self) -> int | None:
        """This process's intra-op threads for the run (engine/threads.py, run_threads)."""
        biggest = max(self.data.clients, key=lambda c: c.x_train.shape[0])
        batch = self.config.train.batch_size or biggest.x_train.shape[0]
        return run_threads(self.config.executor, self.model.module, biggest.x_train[0], batch)

    def run(self, resume: bool = False) -> RunResult:
        with torch_threads(self._threads()):
            self.executor.prepare(self.training.data)
            try:
                with setup_frozen():
                    return self._run(resume)
            except BaseException:
                for callback in self.callbacks:
                    callback.on_failure(self)
                raise
            finally:
                self.executor.close()

    def _run(self, resume: bool) -> RunResult:
        """The round loop: train a round, then every callback (evaluation, monitoring, the
        metrics log, checkpoints ...) in order."""
        state = self.resumed_state() if resume else self.initial_state()
        for callback in self.callbacks:
            callback.on_run_start(self, state)
        for round in range(state.round + 1, self.config.train.rounds + 1):
            report = self.train_round(round, state)
            for callback in self.callbacks:
                callback.on_round_end(self, state, report)
        summary = self.summary(state)
        for callback in self.callbacks:
            callback.on_run_end(self, state, summary)
        global_model = self.algorithm.global_model(state.server)
        return RunResult(
            summary=summary,
            history=state.history,
            global_params={**global_model[0], **global_model[1]} if global_model else None,
            client_params=self.evaluation.deployed,
            run_dir=self.run_dir,
            extras=summary.get("extras", {}),
        )

    def train_round(self, round: int, state: RunState) -> RoundReport:
        """One round: sample, send, train (the executor), screen, transform and aggregate the
        uploads; ``state`` moves to the end of the round."""
        cfg, algorithm, tick = self.config, self.algorithm, time.perf_counter()
        clients = self.training.sample(cfg.seed, round)
        drops = dropouts(cfg.seed, round, clients, cfg.train.dropout)
        new = [c for c in clients if c not in state.clients]
        state.clients.set_many(new, [algorithm.init_client_state(state.server, c) for c in new])
        message = algorithm.server_message(state.server, round)
        if self.privacy is not None:
            self.privacy.start_round(round, message)
        # clients that vanish before uploading do no work (engine/dropout.py)
        tasks = self.tasks_for_round(round, [c for c in clients if uploads(drops.get(c))])
        if isinstance(self.privacy, SampleLevelDP):  # each client's data, once per step
            self.privacy.record({t.client_id: len(t.plan) for t in tasks})
        results = self.executor.run_round(
            algorithm, message, tasks, state.clients.get_many([t.client_id for t in tasks])
        )
        # a dropped client's upload still crossed the network: counted before screening
        up = sum(message_bytes(r.upload) for r in results) if algorithm.communicates else 0
        screened = screen(tasks, results, round, algorithm.config.model_dump(), cfg.train)
        tasks, results = screened.tasks, screened.results
        state.dropped_nonfinite += len(screened.dropped)
        for task, result in zip(tasks, results, strict=True):
            for transform in self.upload_transforms:
                result.upload = transform(result.upload, task.client_id, round)
        kept = [
            (t.client_id, r.state)
            for t, r in zip(tasks, results, strict=True)
            if r.state is not None
        ]
        state.clients.set_many([c for c, _ in kept], [s for _, s in kept])
        down = algorithm.download_bytes(message, clients) if algorithm.communicates else 0
        if results:  # every sampled client dropped out: the server keeps its state
            up, down = self._aggregate(round, state, message, results, drops, up, down)
        state.bytes_up, state.bytes_down = state.bytes_up + up, state.bytes_down + down
        if self.privacy is not None:
            state.privacy = self.privacy.state_dict()
        if self.secure is not None:
            state.secure = self.secure.state_dict()
        state.round = round
        evaluate = round % cfg.eval.every == 0 or round == cfg.train.rounds
        seconds = time.perf_counter() - tick
        return RoundReport(round, clients, message, tasks, results, up, down, seconds, evaluate)

    def _aggregate(
        self,
        round: int,
        state: RunState,
        message: Message,
        results: list[ClientResult],
        drops: dict[int, DropStage],
        up: int,
        down: int,
    ) -> tuple[int, int]:
        """The server step on ``results``; with secure aggregation through its protocol, whose
        bytes replace the uploads' (returned: the round's bytes up and down). A protocol round
        that aborts (too few survivors) leaves the server's state as it was."""
        secure = self.secure
        if secure is None:
            state.server = self.algorithm.aggregate(state.server, results)
            return up, down
        secure.begin(round, message, [r.client_id for r in results], drops)
        try:
            state.server = self.algorithm.aggregate(state.server, results)
        except SecureAggregationAbort as err:
            log.warning(
                "round %d: secure aggregation aborted, the model is unchanged: %s", round, err
            )
            return up, down
        return secure.last["bytes_up"], down + secure.last["bytes_down"]

    def summary(self, state: RunState) -> dict[str, Any]:
        """summary.json (DESIGN.md 3.5) from the state at the end of the run; the callbacks
        add their parts (cold start, heterogeneity)."""
        cfg, wall = self.config, state.elapsed
        last = state.history[-1] if state.history else {}
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
                "bytes_up": state.bytes_up,
                "bytes_down": state.bytes_down,
                "bytes_up_per_round": state.bytes_up / cfg.train.rounds,
                "bytes_down_per_round": state.bytes_down / cfg.train.rounds,
            },
            "wall_seconds": wall,
            "seconds_per_round": wall / cfg.train.rounds,
            "dropped_nonfinite": state.dropped_nonfinite,
        }
        if last.get("new_clients"):
            summary["final"]["new_clients"] = last["new_clients"]
        if self.privacy is not None:
            summary["privacy"] = self.privacy.summary()
        if self.secure is not None:
            summary["secure_aggregation"] = self.secure.summary()
        accuracy = last.get("client_accuracy")
        if accuracy and len(accuracy) == len(self.train_ids):
            # each client's deployed (personalized) model on its own held-out data
            summary["final"]["client_accuracy"] = {
                str(c): a for c, a in zip(self.train_ids, accuracy, strict=True)
            }
        extras = self.algorithm.summary_extras(state.server)
        if extras:
            summary["extras"] = extras
        return summary


@contextmanager
def setup_frozen() -> Iterator[None]:
    """Exempt everything built so far (data, models, arenas) from the cyclic garbage
    collector for the block: its full collections otherwise scan all of it, every few rounds,
    each about as long as a round of many small clients (benchmarks/README.md, Design
    measurements).
    ``gc.freeze`` moves the tracked objects to a permanent generation in O(1); ``unfreeze``
    hands them back, so garbage made before the run is collected after it."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def message_bytes(message: Message) -> int:
    return sum(pytree.num_bytes(tree) for tree in message.values())
