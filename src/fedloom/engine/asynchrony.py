"""Asynchronous aggregation on a virtual clock (issue #20, part 3; docs/asynchrony.md).

Up to ``concurrency`` clients train at once. A client is dispatched with the current global
model (its version v = server steps so far) and finishes ``duration`` virtual time units later
(engine/clock.py); the server folds in what arrives:

- **FedAsync** (Xie et al., 2019, arXiv:1903.03934, Algorithm 1): every arriving model x_new,
  trained from version tau, is mixed in at once: x_t = (1 - alpha_t) x_{t-1} + alpha_t x_new
  with alpha_t = alpha * s(t - tau) (section 5.2's staleness functions).
- **FedBuff** (Nguyen et al., AISTATS 2022, arXiv:2106.06639, Algorithm 1): arriving deltas
  Delta_k = x_k - x_{tau_k}, each scaled by s(staleness), wait in a buffer; every ``buffer``
  = K of them the server steps x <- x + eta_g * mean_k s_k Delta_k (weights: samples or 1).

Both steps go through the algorithm's own server step, ``Algorithm.aggregate``, on rebased
uploads (FedAsync: x + alpha_t (x_new - x); FedBuff: x + eta_g s_k Delta_k): for FedAvg's
weighted mean that is the papers' rule exactly, and an algorithm with a server optimizer
(FedAvgM, FedAdam, ...) applies its optimizer to the same pseudo-gradient, as FedBuff allows.

A "round" is one server step. Asynchrony is a schedule over the round pipeline
(engine/pipeline.py): clients dispatched together (same time, same version) go through its
dispatch stage together (message, training on the executor, screening, the mechanisms' upload
hooks), and the server's steps go through its server stage. Their results wait in flight,
with the clock and the buffer, in the run state (``RunState.asynchrony``, typed records in
engine/async_state.py), so a resumed run equals an uninterrupted one. Arrivals
at the same virtual time are all taken before the freed slots are refilled, which makes
FedBuff with equal speeds and K = concurrency = every client exactly synchronous FedAvg.

Synchronous runs with ``asynchrony.speeds`` get the same clock (:class:`SyncClock`): a round
lasts as long as its slowest reporting client.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fedloom.config import RunConfig
from fedloom.core import pytree
from fedloom.core.mechanism import ServerStep
from fedloom.core.protocol import ClientResult, ClientTask, Message
from fedloom.engine.async_state import Job
from fedloom.engine.clock import Speeds, config_staleness
from fedloom.engine.context import Callback, RunContext
from fedloom.engine.nonfinite import DivergenceError
from fedloom.engine.pipeline import RoundPipeline, SyncRounds
from fedloom.engine.sampling import sample_clients
from fedloom.engine.shell import due
from fedloom.engine.state import RoundReport, RunState
from fedloom.run_config.asynchrony import AsynchronyConfig, SpeedsConfig

CLOCK = "clock"
"""Metrics rows' and summary.json's key of the virtual time."""


def make_schedule(config: RunConfig, ids: list[int]) -> tuple[SyncRounds | AsyncServer, list]:
    """The run's schedule over the training clients ``ids`` and the clock's callbacks (the
    asynchronous server itself, or the clock of synchronous rounds with
    ``asynchrony.speeds``)."""
    cfg = config.asynchrony
    speeds = Speeds(cfg.speeds or SpeedsConfig(), config.seed, ids)
    if cfg.kind != "none":
        server = AsyncServer(cfg, speeds, config.train.clients_per_round or len(ids))
        return server, [server]
    return SyncRounds(), [SyncClock(speeds)] if cfg.speeds is not None else []


class SyncClock(Callback):
    """The virtual clock of synchronous rounds: each round takes as long as the slowest of
    its reporting clients (its completed steps times its time per step)."""

    def __init__(self, speeds: Speeds) -> None:
        self.speeds = speeds

    def on_round_end(self, ctx: RunContext, state: RunState, report: RoundReport) -> dict[str, Any]:
        times = [self.speeds.duration(t.client_id, report.round, len(t.plan)) for t in report.tasks]
        state.asynchrony.clock += max(times, default=0.0)
        return {CLOCK: state.asynchrony.clock}

    def on_run_end(self, ctx: RunContext, state: RunState) -> dict[str, Any]:
        return {CLOCK: state.asynchrony.clock}


class AsyncServer(Callback):
    """FedAsync or FedBuff (module docstring): the run's schedule when ``asynchrony.kind`` is
    not none, and the callback that reports it."""

    def __init__(self, config: AsynchronyConfig, speeds: Speeds, concurrency: int) -> None:
        self.config = config
        self.speeds = speeds
        self.concurrency = config.concurrency or concurrency

    def on_run_end(self, ctx: RunContext, state: RunState) -> dict[str, Any]:
        s = state.asynchrony
        asynchrony = {
            "kind": self.config.kind,
            "concurrency": self.concurrency,
            "updates": s.applied,
            "dispatched": s.events,
            "staleness_mean": s.staleness_sum / s.applied if s.applied else None,
            "staleness_max": s.staleness_max,
        }
        return {CLOCK: s.clock, "asynchrony": asynchrony}

    # -- one server step --------------------------------------------------------------------
    def train_round(self, pipeline: RoundPipeline, round: int, state: RunState) -> RoundReport:
        """Advance the clock until the server takes its next step (round ``round``)."""
        tick, s = time.perf_counter(), state.asynchrony
        up, down = state.bytes_up, state.bytes_down
        message = pipeline.algorithm.server_message(state.server, round)
        applied = self.next_updates(pipeline, round, state)
        staleness = [s.version - j.version for j in applied]
        rebased = self.rebased(state, applied)
        pipeline.server_step(state, ServerStep(round, message, rebased, {}, state.server))
        s.version += 1
        s.applied += len(applied)
        s.staleness_sum += sum(staleness)
        s.staleness_max = max(s.staleness_max, *staleness)
        assert s.version == round, (s.version, round)
        state.round = round
        cfg = pipeline.config
        report = RoundReport(
            round,
            [j.client for j in applied],
            message,
            [self.task(pipeline, j) for j in applied],
            [self.reported(j) for j in applied],
            state.bytes_up - up,
            state.bytes_down - down,
            time.perf_counter() - tick,
            due(round, cfg.eval.every, cfg.train.rounds),
        )
        report.metrics[CLOCK] = s.clock
        report.metrics["asynchrony"] = {
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "in_flight": len(s.in_flight),
            "dispatched": s.events,
        }
        return report

    def next_updates(self, pipeline: RoundPipeline, round: int, state: RunState) -> list[Job]:
        """Dispatch and take arrivals in time order until a server step is due: its updates."""
        s = state.asynchrony
        lost = 0  # arrivals of non-finite results (train.nonfinite: drop) in this step
        while True:
            self.dispatch(pipeline, state)
            job = min(s.in_flight, key=lambda j: (j.finish, j.event, j.client))
            s.in_flight.remove(job)
            s.clock = job.finish
            applied = self.arrive(state, job)
            if applied:
                return applied
            lost += job.delta is None
            if lost > 10 * max(self.concurrency, self.config.buffer):
                raise DivergenceError(
                    f"round {round}: the last {lost} client updates were all non-finite "
                    "(train.nonfinite: drop) and the server cannot step; lower train.lr"
                )

    @staticmethod
    def reported(job: Job) -> ClientResult:
        """What the round's report shows of an applied job: its delta, weight, loss, info."""
        assert job.delta is not None
        return ClientResult(
            {"delta": job.delta["params"]},
            job.weight,
            job.loss,
            info=job.info,
            client_id=job.client,
            round=job.event,
        )

    @staticmethod
    def task(pipeline: RoundPipeline, job: Job) -> ClientTask:
        """The work order ``job`` ran (its minibatch plan made again from its stream)."""
        c, data, lr = job.client, pipeline.training.data[job.client], pipeline.config.train.lr
        make_plan = pipeline.algorithm.ctx.make_plan
        return ClientTask.order(c, data, lr, job.event, make_plan, job.steps, full=job.steps)

    def dispatch(self, pipeline: RoundPipeline, state: RunState) -> None:
        """Fill the free slots with idle clients, sent the current model; they go through the
        pipeline's dispatch stage now (one executor call) and arrive later on the clock.
        Arrivals due at the current time come first: nothing is dispatched while one is
        pending."""
        s = state.asynchrony
        if any(j.finish <= s.clock for j in s.in_flight):
            return
        busy = {j.client for j in s.in_flight}
        idle = [c for c in pipeline.training.data if c not in busy]
        free = min(self.concurrency - len(s.in_flight), len(idle))
        if free <= 0:
            return
        s.events += 1
        clients = sample_clients(pipeline.config.seed, s.events, idle, free)
        sent = pipeline.dispatch(state, s.events, clients, s.version + 1, clients)
        state.bytes_down += sent.down
        finished = {r.client_id: r for r in sent.results}
        for c in clients:
            steps = sent.steps[c]
            job = Job(
                client=c,
                version=s.version,
                event=s.events,
                start=s.clock,
                finish=s.clock + self.speeds.duration(c, s.events, steps),
                steps=steps,
                bytes=sent.sizes.get(c, 0),
            )
            result = finished.get(c)
            if result is not None:
                self.carry(job, sent.message, result)
            s.in_flight.append(job)

    def carry(self, job: Job, message: Message, result: ClientResult) -> None:
        """What an in-flight job carries for the server: its delta from the model it was sent
        (and, for FedAsync, the model itself), its weight, loss, metrics and new state."""
        upload = result.upload
        job.delta = {key: pytree.sub(upload[key], message[key]) for key in ("params", "buffers")}
        job.weight, job.loss = float(result.weight), float(result.loss)
        job.info = {k: float(v) for k, v in result.info.items()}
        job.state = result.state
        if self.config.kind == "fedasync":
            job.model = {key: dict(upload[key]) for key in ("params", "buffers")}

    def arrive(self, state: RunState, job: Job) -> list[Job]:
        """A job reaches the server: its upload counted, its client's state stored; returns
        the updates of the server step it completes (none while FedBuff's buffer fills)."""
        s = state.asynchrony
        state.bytes_up += job.bytes
        if job.delta is None:
            return []
        if job.state is not None:
            state.clients.set_many([job.client], [job.state])
        if self.config.kind == "fedasync":
            return [job]
        s.buffer.append(job)
        if len(s.buffer) < self.config.buffer:
            return []
        applied, s.buffer = s.buffer, []
        return applied

    def rebased(self, state: RunState, applied: list[Job]) -> list[ClientResult]:
        """The uploads the algorithm's server step sees: FedAsync's x + alpha_t (x_new - x)
        (one), FedBuff's x + eta_g s_k Delta_k with weight n_k or 1 (K of them)."""
        cfg, version = self.config, state.asynchrony.version
        server = state.server
        out = []
        for job in applied:
            weight = config_staleness(cfg, version - job.version)
            if cfg.kind == "fedasync":
                assert job.model is not None
                upload = {
                    key: mix(server[key], job.model[key], cfg.alpha * weight)
                    for key in ("params", "buffers")
                }
            else:
                assert job.delta is not None
                upload = {
                    key: step(server[key], job.delta[key], cfg.server_lr * weight)
                    for key in ("params", "buffers")
                }
            w = job.weight if cfg.kind == "fedasync" or cfg.weighting == "samples" else 1.0
            out.append(ClientResult(upload, w, job.loss, client_id=job.client, round=job.event))
        return out


def mix(current: pytree.Tree, new: pytree.Tree, alpha: float) -> pytree.Tree:
    """(1 - alpha) current + alpha new, key by key (``torch.lerp``: exactly ``new`` at alpha
    = 1); integer tensors (BatchNorm's counters) rounded."""
    out = {}
    for key, x in current.items():
        if x.is_floating_point():
            out[key] = torch.lerp(x, new[key].to(x.dtype), alpha)
        else:
            out[key] = torch.lerp(x.double(), new[key].double(), alpha).round().to(x.dtype)
    return out


def step(current: pytree.Tree, delta: pytree.Tree, scale: float) -> pytree.Tree:
    """current + scale * delta, key by key; integer tensors rounded."""
    out = {}
    for key, x in current.items():
        if x.is_floating_point():
            out[key] = x + scale * delta[key].to(x.dtype)
        else:
            out[key] = (x.double() + scale * delta[key].double()).round().to(x.dtype)
    return out
