"""The round loop: sampling, client work, message transforms, aggregation, evaluation,
metrics, checkpoints. Algorithms never re-implement any of it; the evaluation timing,
resume and summary.json's common keys are the run shell's, shared with the RL and vertical
runners (engine/shell.py)."""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from fedloom.algorithms import Algorithm, AlgorithmContext, ClientTask, build_algorithm
from fedloom.config import RunConfig, check_client_counts
from fedloom.core import pytree
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData, ClientResult, Message
from fedloom.data.federated import FederatedData
from fedloom.data.missing import hide_features
from fedloom.data.validation import hold_out_validation
from fedloom.data.validation import pooled as pooled_validation
from fedloom.engine.asynchrony import AsyncServer, make_timing
from fedloom.engine.callbacks import (
    AttackReport,
    Callback,
    Checkpointing,
    ColdStart,
    Evaluation,
    HealthMonitor,
    MetricsLog,
    PrivacyAccounting,
    SecureAggregationLog,
)
from fedloom.engine.contribution import ContributionAndIncentives
from fedloom.engine.dropout import dropouts, uploads
from fedloom.engine.factory import make_executor
from fedloom.engine.mechanisms import Aggregator, Mechanisms, UploadTransform
from fedloom.engine.nonfinite import screen
from fedloom.engine.rundir import RunDir
from fedloom.engine.sampling import TrainingClients
from fedloom.engine.serving import ServingCopies
from fedloom.engine.shell import base_summary, checkpoint_payload, due
from fedloom.engine.state import RoundReport, RunState
from fedloom.engine.state_store import ClientStateStore
from fedloom.engine.threads import run_threads, torch_threads
from fedloom.engine.workload import full_budget, straggler_steps
from fedloom.errors import ConfigError, RoundAborted
from fedloom.models.base import FedModel
from fedloom.peft import build_peft_algorithm
from fedloom.privacy import SampleLevelDP
from fedloom.secure.base import DropStage
from fedloom.solvers.local import PlanMaker

log = logging.getLogger(__name__)


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
        self.run_dir = run_dir
        self.progress = progress
        self.model = FunctionalModel(module, data.task)
        self.executor = make_executor(config.executor, self.model)
        train = config.train
        if config.data.num_clients != data.num_clients:  # else checked when parsed
            check_client_counts(config, data.num_clients)
        data = hide_features(data, config.data.missing, config.seed)  # data.missing: zeroed
        new = config.eval.new_clients
        self.train_ids = list(range(data.num_clients - new))
        self.new_ids = list(range(data.num_clients - new, data.num_clients))
        self.validation: list[ClientData] | None = None
        """Each client's validation set (eval.validation_fraction; data/validation.py)."""
        self.validation_pool: ClientData | None = None
        """All of them as one: the server's held-out set."""
        if config.validation_fraction() > 0:
            data, self.validation = hold_out_validation(
                data, config.validation_fraction(), config.seed, self.train_ids
            )
            self.validation_pool = pooled_validation(self.validation[: len(self.train_ids)])
        self.mechanisms = Mechanisms(config, data, module, self.train_ids)
        self.data = self.mechanisms.data  # the malicious clients' poisoned, if any
        self.upload_transforms = self.mechanisms.upload_transforms(upload_transforms or [])
        sample_dp = self.mechanisms.sample_dp
        ctx = AlgorithmContext(
            model=self.model,
            seed=config.seed,
            num_clients=data.num_clients,
            lr=train.lr,
            batch_size=train.batch_size,
            aggregate=self.mechanisms.aggregator(aggregator),
            make_plan=PlanMaker(config.seed, train.batch_size, poisson=sample_dp is not None),
            rounds=train.rounds,
            population={c: data.clients[c].num_train for c in self.train_ids},
            sample_dp=sample_dp.dpsgd if sample_dp is not None else None,
        )
        self.algorithm: Algorithm = build_peft_algorithm(config, ctx) or build_algorithm(
            config.algorithm, ctx
        )  # PEFT strategies with their own server step (docs/peft.md), else the named one
        program = self.algorithm.client_program()
        if sample_dp is not None and getattr(program, "private", None) is None:
            raise ConfigError(  # declared, but its program has a step of its own
                f"privacy.kind: sample_dp: {self.algorithm.name}'s client program does not take "
                "DP-SGD steps"
            )
        self.training = TrainingClients.view(
            self.data,
            self.train_ids,
            train.clients_per_round,
            self.algorithm.pooled,
            poisson=self.mechanisms.poisson_clients,
        )
        self.evaluation = Evaluation()
        self.timing = make_timing(self)
        """The virtual clock (asynchrony.speeds) and asynchronous aggregation, when configured
        (engine/asynchrony.py)."""
        mechanisms = self.mechanisms
        self.incentives = ContributionAndIncentives.build(config)
        """Contribution evaluation and payments (engine/contribution.py), when configured."""
        self.callbacks: list[Callback] = [
            self.evaluation,
            *([HealthMonitor()] if config.monitor.enabled else []),
            PrivacyAccounting([mechanisms.privacy, *self.upload_transforms]),
            *([SecureAggregationLog(mechanisms.secure)] if mechanisms.secure is not None else []),
            *([AttackReport(mechanisms)] if mechanisms.malicious else []),
            *([ServingCopies(config.serving)] if config.serving.enabled else []),
            *(callbacks or []),
            *([self.incentives] if self.incentives is not None else []),
            *([self.timing] if self.timing is not None else []),
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
        state = RunState.from_checkpoint(checkpoint_payload(self.run_dir), self.new_store())
        self.run_dir.rewrite_metrics(state.history)
        if state.executor_choice and hasattr(self.executor, "choice"):
            self.executor.choice = state.executor_choice  # resume on the same executor
        self.mechanisms.load_state_dict(state.mechanisms)
        return state

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
        if isinstance(self.timing, AsyncServer):  # a round is one asynchronous server step
            return self.timing.train_round(self, round, state)
        cfg, algorithm, tick = self.config, self.algorithm, time.perf_counter()
        clients = self.training.sample(cfg.seed, round)
        drops = dropouts(cfg.seed, round, clients, cfg.train.dropout)
        new = [c for c in clients if c not in state.clients]
        state.clients.set_many(new, [algorithm.init_client_state(state.server, c) for c in new])
        message = algorithm.server_message(state.server, round)
        message = self.mechanisms.broadcast(message)  # compression.download: as decoded
        self.mechanisms.start_round(round, message)
        # clients that vanish before uploading do no work (engine/dropout.py)
        tasks = self.tasks_for_round(round, [c for c in clients if uploads(drops.get(c))])
        if isinstance(self.mechanisms.privacy, SampleLevelDP):  # each client's data, per step
            self.mechanisms.privacy.record({t.client_id: len(t.plan) for t in tasks})
        results = self.executor.run_round(
            algorithm, message, tasks, state.clients.get_many([t.client_id for t in tasks])
        )
        # a dropped client's upload still crossed the network: counted before screening, as
        # encoded when compression is on (the uploads are then what the server decodes)
        up = self.mechanisms.send_uploads(round, results) if algorithm.communicates else 0
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
        down = self.mechanisms.download_bytes(down)  # as encoded (compression.download)
        if results:  # every sampled client dropped out: the server keeps its state
            up, down = self._aggregate(round, state, message, results, drops, up, down)
        state.bytes_up, state.bytes_down = state.bytes_up + up, state.bytes_down + down
        state.mechanisms = self.mechanisms.state_dict()
        state.round = round
        evaluate = due(round, cfg.eval.every, cfg.train.rounds)
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
        """The server step on ``results`` (returned: the round's bytes up and down, secure
        aggregation's protocol traffic when it is on). A round whose server step cannot be
        taken (secure aggregation below its threshold, too few clients for a robust rule)
        leaves the server's state as it was."""
        self.mechanisms.before_aggregate(round, message, results, drops)
        if self.incentives is not None:  # values the clients from the state before the step
            self.incentives.before_server_step(self, round, state, results)
        try:
            state.server = self.algorithm.aggregate(state.server, results)
        except RoundAborted as err:
            log.warning("round %d: no server step, the model is unchanged: %s", round, err)
        return self.mechanisms.round_bytes(up, down)

    def summary(self, state: RunState) -> dict[str, Any]:
        """summary.json (engine/shell.py's common keys, then the horizontal ones) from the
        state at the end of the run; the callbacks add their parts (cold start,
        heterogeneity)."""
        cfg, wall = self.config, state.elapsed
        last = state.history[-1] if state.history else {}
        personalized = {k: v for k, v in (last.get("personalized") or {}).items()}
        summary = base_summary(
            algorithm=self.algorithm.name,
            dataset=self.data.name,
            num_clients=self.data.num_clients,
            rounds=cfg.train.rounds,
            seed=cfg.seed,
            executor=self.executor.name,
            final={"global": last.get("global"), "personalized": personalized},
            communication={
                "bytes_up": state.bytes_up,
                "bytes_down": state.bytes_down,
                "bytes_up_per_round": state.bytes_up / cfg.train.rounds,
                "bytes_down_per_round": state.bytes_down / cfg.train.rounds,
            },
            wall_seconds=wall,
            seconds_per_round=wall / cfg.train.rounds,
        )
        summary["model"] = cfg.model.name
        summary["executor_choice"] = getattr(self.executor, "choice", None) or self.executor.name
        summary["dropped_nonfinite"] = state.dropped_nonfinite
        if last.get("new_clients"):
            summary["final"]["new_clients"] = last["new_clients"]
        summary.update(self.mechanisms.summary())
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
