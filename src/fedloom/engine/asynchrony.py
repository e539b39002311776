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

A "round" is one server step. Clients dispatched together (same time, same version) train
together on the executor; their results wait in flight, with the clock and the buffer, in the
run state (``RunState.asynchrony``), so a resumed run equals an uninterrupted one. Arrivals
at the same virtual time are all taken before the freed slots are refilled, which makes
FedBuff with equal speeds and K = concurrency = every client exactly synchronous FedAvg.

Synchronous runs with ``asynchrony.speeds`` get the same clock (:class:`SyncClock`): a round
lasts as long as its slowest reporting client.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from fedloom.algorithms import Algorithm
from fedloom.config import AsynchronyConfig, RunConfig, SpeedsConfig
from fedloom.core import pytree
from fedloom.core.protocol import ClientResult, ClientTask, Message
from fedloom.engine.clock import Speeds, config_staleness
from fedloom.engine.context import Callback, RunContext
from fedloom.engine.nonfinite import DivergenceError, screen
from fedloom.engine.sampling import sample_clients
from fedloom.engine.state import RoundReport, RunState
from fedloom.engine.workload import client_tasks

CLOCK = "clock"
"""Metrics rows' and summary.json's key of the virtual time."""

Job = dict[str, Any]
"""One dispatched client (in flight, then in the buffer): plain values and tensors, so that
the run state's checkpoint holds it (engine/checkpoint.py)."""


def make_timing(config: RunConfig, ids: list[int]) -> SyncClock | AsyncServer | None:
    """The run's clock over the training clients ``ids``: None for a synchronous run without
    ``asynchrony.speeds``."""
    cfg = config.asynchrony
    speeds = Speeds(cfg.speeds or SpeedsConfig(), config.seed, ids)
    if cfg.kind != "none":
        return AsyncServer(cfg, speeds, config.train.clients_per_round or len(ids))
    return SyncClock(speeds) if cfg.speeds is not None else None


class SyncClock(Callback):
    """The virtual clock of synchronous rounds: each round takes as long as the slowest of
    its reporting clients (its completed steps times its time per step)."""

    def __init__(self, speeds: Speeds) -> None:
        self.speeds = speeds

    def on_round_end(self, ctx: RunContext, state: RunState, report: RoundReport) -> dict[str, Any]:
        times = [self.speeds.duration(t.client_id, report.round, len(t.plan)) for t in report.tasks]
        state.asynchrony[CLOCK] = state.asynchrony.get(CLOCK, 0.0) + max(times, default=0.0)
        return {CLOCK: state.asynchrony[CLOCK]}

    def on_run_end(self, ctx: RunContext, state: RunState) -> dict[str, Any]:
        return {CLOCK: state.asynchrony.get(CLOCK, 0.0)}


class AsyncServer(Callback):
    """FedAsync or FedBuff (module docstring): drives ``Engine.train_round`` when
    ``asynchrony.kind`` is not none."""

    def __init__(self, config: AsynchronyConfig, speeds: Speeds, concurrency: int) -> None:
        self.config = config
        self.speeds = speeds
        self.concurrency = config.concurrency or concurrency

    # -- the run state's part ---------------------------------------------------------------
    @staticmethod
    def state_of(state: RunState) -> dict[str, Any]:
        """``state.asynchrony``, filled in at the start of a run."""
        s = state.asynchrony
        for key, value in (
            (CLOCK, 0.0),
            ("version", 0),  # server steps taken
            ("events", 0),  # dispatch events so far (the key of their random streams)
            ("in_flight", []),
            ("buffer", []),
            ("applied", 0),  # updates folded into the model
            ("staleness_sum", 0),
            ("staleness_max", 0),
        ):
            s.setdefault(key, value)
        return s

    def on_run_end(self, ctx: RunContext, state: RunState) -> dict[str, Any]:
        s = self.state_of(state)
        asynchrony = {
            "kind": self.config.kind,
            "concurrency": self.concurrency,
            "updates": s["applied"],
            "dispatched": s["events"],
            "staleness_mean": s["staleness_sum"] / s["applied"] if s["applied"] else None,
            "staleness_max": s["staleness_max"],
        }
        return {CLOCK: s[CLOCK], "asynchrony": asynchrony}

    # -- one server step --------------------------------------------------------------------
    def train_round(self, ctx: RunContext, round: int, state: RunState) -> RoundReport:
        """Advance the clock until the server takes its next step (round ``round``)."""
        tick, s = time.perf_counter(), self.state_of(state)
        up, down = state.bytes_up, state.bytes_down
        message = ctx.algorithm.server_message(state.server, round)
        lost = 0  # arrivals of non-finite results (train.nonfinite: drop) in this step
        while True:
            self.dispatch(ctx, state)
            job = min(s["in_flight"], key=lambda j: (j["finish"], j["event"], j["client"]))
            s["in_flight"].remove(job)
            s[CLOCK] = job["finish"]
            applied = self.arrive(ctx, state, job)
            if applied:
                break
            lost += job["delta"] is None
            if lost > 10 * max(self.concurrency, self.config.buffer):
                raise DivergenceError(
                    f"round {round}: the last {lost} client updates were all non-finite "
                    "(train.nonfinite: drop) and the server cannot step; lower train.lr"
                )
        staleness = [s["version"] - j["version"] for j in applied]
        state.server = ctx.algorithm.aggregate(state.server, self.rebased(state, applied))
        s["version"] += 1
        s["applied"] += len(applied)
        s["staleness_sum"] += sum(staleness)
        s["staleness_max"] = max(s["staleness_max"], *staleness)
        assert s["version"] == round, (s["version"], round)
        state.mechanisms = ctx.mechanisms.state_dict()
        state.round = round
        cfg = ctx.config
        report = RoundReport(
            round,
            [j["client"] for j in applied],
            message,
            [self.task(ctx, j) for j in applied],
            [self.reported(j) for j in applied],
            state.bytes_up - up,
            state.bytes_down - down,
            time.perf_counter() - tick,
            round % cfg.eval.every == 0 or round == cfg.train.rounds,
        )
        report.metrics[CLOCK] = s[CLOCK]
        report.metrics["asynchrony"] = {
            "staleness_mean": sum(staleness) / len(staleness),
            "staleness_max": max(staleness),
            "in_flight": len(s["in_flight"]),
            "dispatched": s["events"],
        }
        return report

    @staticmethod
    def reported(job: Job) -> ClientResult:
        """What the round's report shows of an applied job: its delta, weight, loss, info."""
        return ClientResult(
            {"delta": job["delta"]["params"]},
            job["weight"],
            job["loss"],
            info=job["info"],
            client_id=job["client"],
            round=job["event"],
        )

    @staticmethod
    def task(ctx: RunContext, job: Job) -> ClientTask:
        """The work order ``job`` ran (its minibatch plan made again from its stream)."""
        c, data = job["client"], ctx.training.data[job["client"]]
        plan = ctx.algorithm.ctx.make_plan(data, job["steps"], "batches", job["event"], c)
        return ClientTask(c, data, plan, ctx.config.train.lr, job["event"], full=job["steps"])

    def dispatch(self, ctx: RunContext, state: RunState) -> None:
        """Fill the free slots with idle clients, sent the current model; they train now (one
        executor call) and arrive later on the clock. Arrivals due at the current time come
        first: nothing is dispatched while one is pending."""
        s, algorithm, cfg = state.asynchrony, ctx.algorithm, ctx.config
        flight = s["in_flight"]
        if any(j["finish"] <= s[CLOCK] for j in flight):
            return
        busy = {j["client"] for j in flight}
        idle = [c for c in ctx.training.data if c not in busy]
        free = min(self.concurrency - len(flight), len(idle))
        if free <= 0:
            return
        s["events"] += 1
        event = s["events"]
        clients = sample_clients(cfg.seed, event, idle, free)
        message = algorithm.server_message(state.server, s["version"] + 1)
        message = ctx.mechanisms.broadcast(message)  # compression.download: as decoded
        new = [c for c in clients if c not in state.clients]
        state.clients.set_many(new, [algorithm.init_client_state(state.server, c) for c in new])
        ctx.mechanisms.start_round(event, message)
        tasks = client_tasks(
            cfg.train, cfg.seed, ctx.training.data, algorithm.ctx.make_plan, event, clients
        )
        results = ctx.executor.run_round(
            algorithm, message, tasks, state.clients.get_many([t.client_id for t in tasks])
        )
        if algorithm.communicates:  # as encoded when compression is on, as in synchronous rounds
            down = algorithm.download_bytes(message, clients)
            state.bytes_down += ctx.mechanisms.download_bytes(down)
        sizes = [
            ctx.mechanisms.send_upload(event, r) if algorithm.communicates else 0 for r in results
        ]
        kept = screen(tasks, results, event, algorithm.config.model_dump(), cfg.train)
        state.dropped_nonfinite += len(kept.dropped)
        finished = dict(zip([t.client_id for t in kept.tasks], kept.results, strict=True))
        for task, size in zip(tasks, sizes, strict=True):
            c = task.client_id
            job: Job = {
                "client": c,
                "version": s["version"],
                "event": event,
                "start": s[CLOCK],
                "finish": s[CLOCK] + self.speeds.duration(c, event, len(task.plan)),
                "steps": len(task.plan),
                "bytes": size,
                "delta": None,  # a non-finite result: its slot frees on arrival, nothing else
            }
            result = finished.get(c)
            if result is not None:
                for transform in ctx.upload_transforms:
                    result.upload = transform(result.upload, c, event)
                job.update(self.payload(algorithm, message, result))
            flight.append(job)

    def payload(self, algorithm: Algorithm, message: Message, result: ClientResult) -> Job:
        """What an in-flight job carries for the server: its delta from the model it was sent
        (and, for FedAsync, the model itself), its weight, loss, metrics and new state."""
        upload = result.upload
        delta = {key: pytree.sub(upload[key], message[key]) for key in ("params", "buffers")}
        out: Job = {
            "delta": delta,
            "weight": float(result.weight),
            "loss": float(result.loss),
            "info": {k: float(v) for k, v in result.info.items()},
            "state": result.state,
        }
        if self.config.kind == "fedasync":
            out["model"] = {key: dict(upload[key]) for key in ("params", "buffers")}
        return out

    def arrive(self, ctx: RunContext, state: RunState, job: Job) -> list[Job]:
        """A job reaches the server: its upload counted, its client's state stored; returns
        the updates of the server step it completes (none while FedBuff's buffer fills)."""
        s = state.asynchrony
        state.bytes_up += job["bytes"]
        if job["delta"] is None:
            return []
        if job.get("state") is not None:
            state.clients.set_many([job["client"]], [job["state"]])
        if self.config.kind == "fedasync":
            return [job]
        s["buffer"].append(job)
        if len(s["buffer"]) < self.config.buffer:
            return []
        applied, s["buffer"] = s["buffer"], []
        return applied

    def rebased(self, state: RunState, applied: list[Job]) -> list[ClientResult]:
        """The uploads the algorithm's server step sees: FedAsync's x + alpha_t (x_new - x)
        (one), FedBuff's x + eta_g s_k Delta_k with weight n_k or 1 (K of them)."""
        cfg, version = self.config, state.asynchrony["version"]
        server = state.server
        out = []
        for job in applied:
            weight = config_staleness(cfg, version - job["version"])
            if cfg.kind == "fedasync":
                upload = {
                    key: mix(server[key], job["model"][key], cfg.alpha * weight)
                    for key in ("params", "buffers")
                }
            else:
                upload = {
                    key: step(server[key], job["delta"][key], cfg.server_lr * weight)
                    for key in ("params", "buffers")
                }
            w = job["weight"] if cfg.kind == "fedasync" or cfg.weighting == "samples" else 1.0
            out.append(
                ClientResult(upload, w, job["loss"], client_id=job["client"], round=job["event"])
            )
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
