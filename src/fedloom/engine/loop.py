"""The horizontal round loop: a round through the round pipeline (engine/pipeline.py), then the
callbacks (evaluation, monitoring, the caller's ...), then the run shell's metrics row and
checkpoint (engine/shell.py: the run directory, resume, metrics.jsonl, trackers, progress and
summary.json of every run family). Algorithms never re-implement any of it."""

from __future__ import annotations

import gc
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from fedloom.config import RunConfig
from fedloom.core.files import one_line
from fedloom.core.protocol import ClientTask
from fedloom.data.federated import FederatedData
from fedloom.engine.build import EngineParts, build_parts
from fedloom.engine.checkpoint import Check
from fedloom.engine.checkpoint_fit import run_fit
from fedloom.engine.context import Callback, RunContext, merge
from fedloom.engine.executor import Executor
from fedloom.engine.nonfinite import warn_all_dropped
from fedloom.engine.rundir import RunDir
from fedloom.engine.shell import RunResult, RunShell, Timing, base_summary
from fedloom.engine.state import RoundReport, RunState
from fedloom.engine.state_store import ClientStateStore
from fedloom.engine.threads import run_threads, torch_threads
from fedloom.engine.workload import client_tasks
from fedloom.errors import RunDirError
from fedloom.models.base import FedModel

log = logging.getLogger(__name__)


class Engine(EngineParts):
    """One run: its parts (engine/build.py), the round loop (``train_round``) and the
    callbacks around it, which see the parts as a read-only ``RunContext``
    (engine/context.py)."""

    def __init__(
        self,
        config: RunConfig,
        data: FederatedData,
        module: FedModel,
        callbacks: list[Callback] | None = None,
    ) -> None:
        """``callbacks`` run after the built-in evaluation, monitoring and privacy accounting
        and before the shell's metrics row and checkpoint (engine/build.py,
        default_callbacks)."""
        parts = build_parts(config, data, module, callbacks)
        super().__init__(**vars(parts))
        self.run_dir: RunDir | None = None
        """The run shell's directory, once the run has started (``run``)."""

    @property
    def name(self) -> tuple[str, str]:
        """(algorithm, dataset): a new run directory's default name."""
        return self.config.algorithm.name, self.data.name

    def use_executor(self, executor: Executor) -> None:
        """Run the clients on ``executor`` instead of the config's (the Flower adapter's)."""
        self.executor = self.pipeline.executor = executor

    def context(self) -> RunContext:
        """What the callbacks read (the current executor and run directory included)."""
        return self.view(self.run_dir)

    def tasks_for_round(self, round: int, clients: list[int]) -> list[ClientTask]:
        """Work orders of the clients that report back this round (engine/workload.py)."""
        make_plan = self.algorithm.ctx.make_plan
        train, seed = self.config.train, self.config.seed
        return client_tasks(train, seed, self.training.data, make_plan, round, clients)

    # -- the loop -------------------------------------------------------------------------
    def new_store(self) -> ClientStateStore:
        directory = self.run_dir.file("state") if self.run_dir is not None else None
        slots = self.data.num_clients + 1  # the last slot: a pooled view's client (id -1)
        return ClientStateStore(slots, self.config.state.storage, directory)

    def initial_state(self) -> RunState:
        params, buffers = self.model.initial_state(self.config.seed)
        return RunState(self.algorithm.init_server_state(params, buffers), self.new_store())

    def checkpoint_fit(self) -> Check:
        """What this run expects of a checkpoint it reads (engine/checkpoint_fit.py): its
        model's dtypes and shapes, its fresh state's kinds, one table row per client slot."""
        params, buffers = self.model.initial_state(self.config.seed)
        fresh = self.initial_state()
        return run_fit({**params, **buffers}, fresh.checkpoint(), fresh.clients.num_clients)

    def start(self, shell: RunShell) -> RunState:
        """A fresh state, or a resumed run's from the newest good checkpoint (the shell
        continues its history and clock)."""
        if not shell.resuming:
            state = self.initial_state()
            state.history = shell.history
            return state
        saved = shell.resume_from(self.checkpoint_fit())
        assert saved is not None and self.run_dir is not None
        try:
            state = RunState.from_checkpoint(saved, self.new_store())
            self.mechanisms.load_state_dict(state.mechanisms)
        except (KeyError, ValueError, TypeError, RuntimeError) as err:  # a changed config
            raise RunDirError(
                f"cannot resume {self.run_dir.path}: its checkpoint of round {saved['round']} "
                f"does not fit the run's config ({type(err).__name__}: {one_line(err)[:300]})"
            ) from None
        if state.executor_choice and hasattr(self.executor, "choice"):
            self.executor.choice = state.executor_choice  # resume on the same executor
        shell.continue_from(state.round, state.history, state.elapsed)
        return state

    def checkpoint(self, state: RunState) -> dict[str, Any]:
        """The payload of a checkpoint (engine/state.py), ``auto``'s executor choice in it."""
        state.executor_choice = getattr(self.executor, "choice", None)
        return state.checkpoint()

    def _threads(self) -> int | None:
        """This process's intra-op threads for the run (engine/threads.py, run_threads)."""
        biggest = max(self.data.clients, key=lambda c: c.x_train.shape[0])
        batch = self.config.train.batch_size or biggest.x_train.shape[0]
        return run_threads(self.config.executor, self.model.module, biggest.x_train[0], batch)

    def run(self, shell: RunShell | None = None) -> RunResult:
        """The whole run through ``shell`` (engine/shell.py), summary.json included; without
        one, in memory: no run directory, no progress bar (``fedloom.run`` builds the shell)."""
        if shell is None:
            shell = RunShell(None, self.config, horizontal_timing(self.config), self.name)
        return shell.run(self.run_in)

    def run_in(self, shell: RunShell) -> RunResult:
        """The rounds left, through ``shell``; the callbacks hear of a failure."""
        self.run_dir = shell.run_dir
        with torch_threads(self._threads()):
            self.executor.prepare(self.training.data)
            try:
                with setup_frozen():
                    return self._run(shell)
            except BaseException:
                ctx = self.context()
                for callback in self.callbacks:
                    callback.on_failure(ctx)
                raise
            finally:
                self.executor.close()

    def _run(self, shell: RunShell) -> RunResult:
        """The round loop: train a round, then every callback (evaluation, monitoring ...) in
        order, then the shell's metrics row and checkpoint."""
        state = self.start(shell)
        ctx = self.context()
        for callback in self.callbacks:
            callback.on_run_start(ctx, state)
        shell.begin()
        for round in range(state.round + 1, self.config.train.rounds + 1):
            report = self.train_round(round, state)
            for callback in self.callbacks:  # each sees the metrics of those before it
                merge(report.metrics, callback.on_round_end(ctx, state, report))
            state.elapsed = shell.elapsed
            row = metrics_row(state, report) if report.evaluate else None
            shell.end_round(round, row, lambda: self.checkpoint(state))
        summary = self.summary(state)
        warn_all_dropped(self.pipeline.all_dropped, self.config.train.lr)
        for callback in self.callbacks:
            merge(summary, callback.on_run_end(ctx, state))
        for callback in self.callbacks:
            callback.on_summary(ctx, summary)
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
        """One round through the round pipeline (engine/pipeline.py) under the run's schedule
        (synchronous rounds or asynchronous aggregation); ``state`` moves to its end."""
        report = self.schedule.train_round(self.pipeline, round, state)
        state.mechanisms = self.mechanisms.state_dict()
        return report

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


def horizontal_timing(config: RunConfig) -> Timing:
    """The run shell's rounds, ``eval.every`` and ``checkpoint:`` of a horizontal run."""
    return Timing(config.train.rounds, config.eval.every, config.checkpoint)


def metrics_row(state: RunState, report: RoundReport) -> dict[str, Any]:
    """An evaluated round's metrics row (README.md, "Run directory"): the round's counts and
    the callbacks' metrics, cumulative communication, and the seconds spent."""
    info = report.client_info()
    measured = dict(report.metrics)
    timed = dict(measured.pop("seconds", {}))  # callbacks' own (monitor, contribution)
    return {
        "round": report.round,
        "wall_seconds": state.elapsed,
        "train_loss": report.train_loss,
        "participants": len(report.participants),
        "reported": len(report.results),
        "dropped_nonfinite": state.dropped_nonfinite,
        **({"client_info": info} if info else {}),
        **measured,
        "communication": {
            "bytes_up": state.bytes_up,
            "bytes_down": state.bytes_down,
            "bytes_up_round": report.bytes_up,
            "bytes_down_round": report.bytes_down,
        },
        "seconds": {
            "round": report.train_seconds,
            "monitor": timed.pop("monitor", 0.0),
            **timed,
        },
    }


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
