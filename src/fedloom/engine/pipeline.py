"""The round pipeline, written once: message -> train -> screen -> transform for a dispatch of
clients, then the server step (mechanisms, aggregation). A schedule decides when clients are
dispatched and when the server steps: :class:`SyncRounds` samples clients and steps once per
round; asynchronous aggregation (engine/asynchrony.py) dispatches into free slots and steps
when updates arrive. Both call the same two stages, so a mechanism (core/mechanism.py) sees the
same hooks under either."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from fedloom.algorithms import Algorithm
from fedloom.config import RunConfig
from fedloom.core.mechanism import ServerStep
from fedloom.core.protocol import ClientResult, ClientTask, Message
from fedloom.engine.dropout import dropouts, uploads
from fedloom.engine.executor import Executor
from fedloom.engine.mechanisms import Mechanisms
from fedloom.engine.nonfinite import screen
from fedloom.engine.sampling import TrainingClients
from fedloom.engine.shell import due
from fedloom.engine.state import RoundReport, RunState
from fedloom.engine.workload import client_tasks
from fedloom.errors import RoundAborted

log = logging.getLogger(__name__)


@dataclass
class Dispatch:
    """What one dispatch of clients produced."""

    message: Message
    """The server's message as the clients received it (decoded)."""
    tasks: list[ClientTask]
    results: list[ClientResult]
    """The finite results (``tasks`` theirs, in order), uploads as the server aggregates them."""
    sizes: dict[int, int]
    """Each trained client's upload's bytes on the wire (non-finite ones included)."""
    steps: dict[int, int]
    """Each trained client's completed local steps."""
    down: int
    """The dispatch's bytes down, as encoded."""


@dataclass(eq=False)
class RoundPipeline:
    """The stages of a round over one run's parts (engine/build.py)."""

    config: RunConfig
    algorithm: Algorithm
    mechanisms: Mechanisms
    executor: Executor
    training: TrainingClients
    all_dropped: list[int] = field(default_factory=list)
    """Rounds (of this process) in which every trained client was dropped as non-finite."""

    def dispatch(
        self, state: RunState, round: int, clients: list[int], version: int, training: list[int]
    ) -> Dispatch:
        """Send the server's message (of ``version``) to ``clients``; those in ``training``
        (clients that vanish before uploading do no work) train on the executor, their
        uploads are sent, screened and transformed; ``round`` keys the random streams."""
        cfg, algorithm, mechanisms = self.config, self.algorithm, self.mechanisms
        new = [c for c in clients if c not in state.clients]
        state.clients.set_many(new, [algorithm.init_client_state(state.server, c) for c in new])
        message = mechanisms.start_round(round, algorithm.server_message(state.server, version))
        make_plan = algorithm.ctx.make_plan
        tasks = client_tasks(cfg.train, cfg.seed, self.training.data, make_plan, round, training)
        mechanisms.on_dispatch(round, tasks)
        ids = [t.client_id for t in tasks]
        results = self.executor.run_round(algorithm, message, tasks, state.clients.get_many(ids))
        communicates = algorithm.capabilities.communicates
        # a result screened out still crossed the network: counted before screening
        sizes = {r.client_id: mechanisms.send(round, r) if communicates else 0 for r in results}
        kept = screen(tasks, results, round, algorithm.config.model_dump(), cfg.train)
        state.dropped_nonfinite += len(kept.dropped)
        if kept.dropped and not kept.results:
            self.all_dropped.append(round)
            log.warning("round %d: every client's result was non-finite and dropped", round)
        for task, result in zip(kept.tasks, kept.results, strict=True):
            result.upload = mechanisms.on_upload(result.upload, task.client_id, round)
        down = algorithm.wire.download_bytes(message, clients) if communicates else 0
        steps = {t.client_id: len(t.plan) for t in tasks}
        down = mechanisms.download_bytes(down)
        return Dispatch(message, kept.tasks, kept.results, sizes, steps, down)

    def server_step(self, state: RunState, step: ServerStep) -> None:
        """The algorithm's server step on ``step.results``, the mechanisms told first. A step
        that cannot be taken (secure aggregation below its threshold, too few clients for a
        robust rule) leaves the server's state as it was."""
        self.mechanisms.before_aggregate(step)
        try:
            state.server = self.algorithm.aggregate(state.server, list(step.results))
        except RoundAborted as err:
            log.warning("round %d: no server step, the model is unchanged: %s", step.round, err)


class Schedule(Protocol):
    """When clients train and the server steps: one call takes the run to the end of round
    ``round`` (one server step)."""

    def train_round(self, pipeline: RoundPipeline, round: int, state: RunState) -> RoundReport: ...


class SyncRounds:
    """Synchronous rounds: sample, dispatch everyone at once, one server step on what comes
    back (clients that vanish per ``train.dropout`` included as secure aggregation sees
    them; engine/dropout.py)."""

    def train_round(self, pipeline: RoundPipeline, round: int, state: RunState) -> RoundReport:
        cfg, tick = pipeline.config, time.perf_counter()
        clients = pipeline.training.sample(cfg.seed, round)
        drops = dropouts(cfg.seed, round, clients, cfg.train.dropout)
        training = [c for c in clients if uploads(drops.get(c))]
        sent = pipeline.dispatch(state, round, clients, round, training)
        kept = [(t.client_id, r.state) for t, r in zip(sent.tasks, sent.results, strict=True)]
        kept = [(c, s) for c, s in kept if s is not None]
        state.clients.set_many([c for c, _ in kept], [s for _, s in kept])
        up, down = sum(sent.sizes.values()), sent.down
        if sent.results:  # every sampled client dropped out: the server keeps its state
            step = ServerStep(round, sent.message, sent.results, drops, state.server)
            pipeline.server_step(state, step)
            up, down = pipeline.mechanisms.round_bytes(up, down)
        state.bytes_up, state.bytes_down = state.bytes_up + up, state.bytes_down + down
        state.round = round
        evaluate = due(round, cfg.eval.every, cfg.train.rounds)
        seconds = time.perf_counter() - tick
        return RoundReport(
            round, clients, sent.message, sent.tasks, sent.results, up, down, seconds, evaluate
        )
