"""Contribution evaluation and incentive payments during a run (docs/incentives.md; spec
incentives.md 3.1-3.2), beside any algorithm with a global model.

Contribution: in each valued round (``contribution.every``), just before the real server step,
the game of the round's uploads is played: v(S) is the validation metric of
``global_model(aggregate(server_before, uploads of S))``, the model the algorithm's own server
step would build from coalition S (v(empty): the model before the round). The estimator
(exact, leave-one-out, TMC or GTG; incentives/shapley.py) values each participant; the
coalition models are evaluated on the held-out validation split (data/validation.py), many
at once under ``vmap`` when the estimator knows its coalitions up front (exact, LOO).

Incentives: after every round, FLI and its baselines pay the same budget to the round's
participants (incentives/book.py), each participant's cost from the declared cost model
(samples it processed, bytes it uploaded; incentives/costs.py). The book's state rides in
``RunState.mechanisms['incentives']``, so checkpoints carry the queues and a resumed run pays
as the uninterrupted one.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from fedloom.config import RunConfig
from fedloom.core import pytree
from fedloom.core.functional import FunctionalModel
from fedloom.core.mechanism import Mechanism, ServerStep
from fedloom.core.protocol import ClientData, ClientResult, ClientTask, State
from fedloom.core.rng import numpy_rng
from fedloom.engine.context import Callback, RunContext
from fedloom.engine.evaluation import evaluate_each, evaluate_shared
from fedloom.engine.state import RoundReport, RunState
from fedloom.errors import ConfigError, RoundAborted
from fedloom.incentives.baselines import NEEDS_CONTRIBUTION, SCHEMES
from fedloom.incentives.book import IncentiveBook
from fedloom.incentives.costs import CostModel
from fedloom.incentives.shapley import CachedGame, Coalition, Convergence, Valuation, estimate

STATE_KEY = "incentives"
"""The key of this module's state in ``RunState.mechanisms`` (checkpointed with the run)."""

Model = tuple[pytree.Tree, pytree.Tree]

CHUNK = 16
"""Coalition models built and evaluated together (one vmapped forward per batch)."""


def evaluate_models(
    model: FunctionalModel,
    models: Sequence[Model],
    data: ClientData,
    batch_size: int,
    chunk_size: int = 16,
) -> list[tuple[float, float]]:
    """(mean loss, accuracy) of each model on ``data``'s held-out part: ``chunk_size`` models
    per vmapped forward over the same batches (engine/evaluation.py, evaluate_shared); one
    model at a time for a module ``vmap`` cannot batch (the same numbers, slower)."""
    try:
        counts = evaluate_shared(model, list(models), data, batch_size, chunk_size)
    except (RuntimeError, NotImplementedError):  # e.g. a fused RNN kernel without a batch rule
        counts = evaluate_each(model, list(models), [data] * len(models), batch_size)
    n = max(data.num_test, 1)
    return [(c.loss_sum / n, c.correct / n) for c in counts]


class RoundGame:
    """The game of one round: v(S) from the server state before the round's server step and
    the round's uploads (a coalition is a sorted tuple of client ids)."""

    def __init__(self, ctx: RunContext, server: State, results: Sequence[ClientResult]) -> None:
        self.ctx = ctx
        self.server = server
        self.results = {r.client_id: r for r in results}
        self.metric = ctx.config.contribution.metric

    def model(self, coalition: Coalition) -> Model:
        """The global model the server step builds from ``coalition``'s uploads (the model
        before the round for the empty coalition, or when the step cannot be taken)."""
        algorithm = self.ctx.algorithm
        server = self.server
        if coalition:
            try:
                server = algorithm.aggregate(self.server, [self.results[c] for c in coalition])
            except RoundAborted:  # e.g. a robust rule's precondition: the model is unchanged
                server = self.server
        model = algorithm.global_model(server)
        assert model is not None  # checked when the run starts
        return model

    def score(self, loss: float, accuracy: float) -> float:
        return accuracy if self.metric == "accuracy" else -loss

    def many(self, coalitions: list[Coalition]) -> list[float]:
        """v of each coalition, their models built and evaluated ``CHUNK`` at a time (exact
        Shapley's 2^n never all in memory); the mechanisms' state (a robust rule's counters)
        restored."""
        ctx = self.ctx
        pool = ctx.validation_pool
        assert pool is not None  # the engine holds one out when contribution is on
        batch = ctx.config.eval.batch_size
        values: list[float] = []
        for lo in range(0, len(coalitions), CHUNK):
            saved = ctx.mechanisms.state_dict()
            try:
                models = [self.model(c) for c in coalitions[lo : lo + CHUNK]]
            finally:
                ctx.mechanisms.load_state_dict(saved)
            scores = evaluate_models(ctx.model, models, pool, batch, CHUNK)
            values += [self.score(*m) for m in scores]
        return values

    def __call__(self, coalition: Coalition) -> float:
        return self.many([coalition])[0]


def samples_processed(task: ClientTask) -> int:
    """Training samples the client's local steps went through (its plan's minibatches)."""
    return sum(int(batch.numel()) for batch in task.plan)


def _keyed(values: dict[int, float]) -> dict[str, float]:
    return {str(k): v for k, v in sorted(values.items())}


class IncentiveLedger:
    """``contribution`` and ``incentive`` of the run config: the values, the pay book and
    what the next metrics row reports, shared by the round's mechanism that values the uploads
    (:class:`ContributionValuation`) and the callback that pays and reports
    (:class:`IncentivePayments`); its state is checkpointed as ``incentives``."""

    def __init__(self, config: RunConfig) -> None:
        self.config = config
        contribution, incentive = config.contribution, config.incentive
        self.valuing = contribution.kind != "none"
        self.book: IncentiveBook | None = None
        if incentive.kind != "none":
            schemes = [s for s in SCHEMES if self.valuing or s not in NEEDS_CONTRIBUTION]
            head = [incentive.kind, *(s for s in schemes if s != incentive.kind)]
            self.book = IncentiveBook(head, incentive.budget, incentive.omega, incentive.sub_rounds)
        cost = incentive.cost
        self.costs = CostModel(cost.per_sample, cost.per_mb, cost.per_client)
        self.convergence = Convergence(maximum=contribution.max_permutations)
        self.ctx: RunContext | None = None
        """The run's context, from the payments' ``on_run_start`` (the coalition models are
        built and evaluated with it)."""
        self._reset()
        self.valuation = ContributionValuation(self)
        self.payments = IncentivePayments(self)

    def _reset(self) -> None:
        self.total: dict[int, float] = {}
        """Each client's cumulative contribution (the estimator's reported values)."""
        self.total_raw: dict[int, float] = {}
        self.latest: dict[int, float] = {}
        """Each client's latest per-round value (what rounds not valued pay by)."""
        self.evaluations = 0
        self.rounds_valued = 0
        self.seconds = 0.0
        self.pending: dict[str, dict[str, Any]] = {"contribution": {}, "incentive": {}}
        """Per-round entries since the last metrics row (the next row carries them)."""
        self.pending_seconds = 0.0
        self.current: Valuation | None = None
        """The latest valued round's values."""
        self.game: CachedGame | None = None
        """... and its game: every coalition value it evaluated (benchmarks, tests)."""

    @classmethod
    def build(cls, config: RunConfig) -> IncentiveLedger | None:
        """The ledger, or None when both sections are off."""
        if config.contribution.kind == "none" and config.incentive.kind == "none":
            return None
        return cls(config)

    def value(self, step: ServerStep) -> None:
        """Value the round's participants (a valued round), from the server state before the
        server step."""
        self.current = self.game = None
        round, results = step.round, step.results
        if not self.valuing or round % self.config.contribution.every:
            return
        assert self.ctx is not None, "on_run_start first"
        tick = time.perf_counter()
        cfg = self.config.contribution
        game = RoundGame(self.ctx, step.server, results)
        cached = CachedGame(game, game.many)
        players = sorted(r.client_id for r in results)
        rng = numpy_rng(self.config.seed, "contribution", round)
        value = estimate(cfg.kind, cached, players, rng, cfg.tolerance, self.convergence)
        self.current, self.game = value, cached
        for c in players:
            self.total[c] = self.total.get(c, 0.0) + value.reported[c]
            self.total_raw[c] = self.total_raw.get(c, 0.0) + value.raw[c]
            self.latest[c] = value.reported[c]
        self.evaluations += value.evaluations
        self.rounds_valued += 1
        self.pending["contribution"][str(round)] = {
            "values": _keyed(value.reported),
            **({"raw": _keyed(value.raw)} if value.rescaled is not None else {}),
            "gain": value.gain,
            "evaluations": value.evaluations,
            **({"permutations": value.permutations} if value.permutations else {}),
            **({"truncated": True} if value.truncated else {}),
        }
        seconds = time.perf_counter() - tick
        self.seconds += seconds
        self.pending_seconds += seconds

    def pay(self, ctx: RunContext, report: RoundReport) -> None:
        """Every scheme pays this round's budget to the round's participants."""
        assert self.book is not None
        communicates = ctx.algorithm.capabilities.communicates
        cost: dict[int, float] = {}
        samples: dict[int, float] = {}
        for task, result in zip(report.tasks, report.results, strict=True):
            c = task.client_id
            up = sum(pytree.num_bytes(t) for t in result.upload.values()) if communicates else 0
            cost[c] = self.costs.cost(c, samples_processed(task), up)
            samples[c] = float(task.data.num_train)
        contribution = {c: self.latest.get(c, 0.0) for c in cost} if self.valuing else None
        paid = self.book.pay(report.round, cost, contribution, samples)
        self.pending["incentive"][str(report.round)] = {
            "pay": {s: _keyed(p) for s, p in paid.items()},
            "cost": _keyed(cost),
        }

    def row(self) -> dict[str, Any]:
        """The metrics row's ``contribution`` and ``incentive`` entries: every round since the
        previous row, and the running totals (queues, pay, Jain's index per scheme)."""
        out: dict[str, Any] = {}
        if self.valuing:
            out["contribution"] = {
                "rounds": self.pending["contribution"],
                "cumulative": _keyed(self.total),
            }
            out["seconds"] = {"contribution": self.pending_seconds}
        if self.book is not None:
            book = self.book
            out["incentive"] = {
                "kind": book.schemes[0],
                "rounds": self.pending["incentive"],
                "cumulative": {s: _keyed(book.ledgers[s].paid) for s in book.schemes},
                "regret": {s: _keyed(book.ledgers[s].regret) for s in book.schemes},
                "waiting": {s: _keyed(book.ledgers[s].waiting) for s in book.schemes},
                "jain": {s: book.fairness(s)["jain_payoff_per_cost"] for s in book.schemes},
                "cost": _keyed(book.cost),
            }
        return out

    def summary(self) -> dict[str, Any]:
        """summary.json's ``contribution`` and ``incentive`` sections."""
        summary: dict[str, Any] = {}
        if self.valuing:
            cfg = self.config.contribution
            summary["contribution"] = {
                "kind": cfg.kind,
                "metric": cfg.metric,
                "per_client": _keyed(self.total),
                "per_client_raw": _keyed(self.total_raw),
                "rounds_valued": self.rounds_valued,
                "evaluations": self.evaluations,
                "evaluations_per_round": self.evaluations / max(self.rounds_valued, 1),
                "seconds": self.seconds,
                "seconds_per_round": self.seconds / max(self.rounds_valued, 1),
            }
        if self.book is not None:
            summary["incentive"] = {
                "kind": self.book.schemes[0],
                "budget": self.book.budget,
                "omega": self.book.omega,
                "sub_rounds": self.book.sub_rounds,
                **self.book.summary(),
            }
        return summary

    def state_dict(self) -> dict[str, Any]:
        return {
            "total": _keyed(self.total),
            "total_raw": _keyed(self.total_raw),
            "latest": _keyed(self.latest),
            "evaluations": self.evaluations,
            "rounds_valued": self.rounds_valued,
            "seconds": self.seconds,
            "pending": self.pending,
            "pending_seconds": self.pending_seconds,
            "book": self.book.state_dict() if self.book is not None else None,
        }

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        def ints(values: dict[str, float]) -> dict[int, float]:
            return {int(k): float(v) for k, v in values.items()}

        self.total, self.total_raw = ints(saved["total"]), ints(saved["total_raw"])
        self.latest = ints(saved["latest"])
        self.evaluations = int(saved["evaluations"])
        self.rounds_valued = int(saved["rounds_valued"])
        self.seconds = float(saved["seconds"])
        self.pending = saved["pending"]
        self.pending_seconds = float(saved["pending_seconds"])
        if self.book is not None and saved.get("book"):
            self.book.load_state_dict(saved["book"])


class ContributionValuation(Mechanism):
    """The round's mechanism (core/mechanism.py; the last in order): it values the round's
    uploads just before the server step, and carries the ledger's state in checkpoints."""

    key = STATE_KEY

    def __init__(self, ledger: IncentiveLedger) -> None:
        self.ledger = ledger

    @property
    def game(self) -> CachedGame | None:
        """The latest valued round's game (benchmarks, tests)."""
        return self.ledger.game

    def before_aggregate(self, step: ServerStep) -> None:
        self.ledger.value(step)

    def state_dict(self) -> dict[str, Any]:
        return self.ledger.state_dict()

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.ledger.load_state_dict(saved)


class IncentivePayments(Callback):
    """The callback: after every round the schemes pay, and the evaluated rounds' rows and
    summary.json report the ledger."""

    def __init__(self, ledger: IncentiveLedger) -> None:
        self.ledger = ledger

    # -- the run ---------------------------------------------------------------------------
    def on_run_start(self, ctx: RunContext, state: RunState) -> None:
        """Checks what only the data can tell (the config's rules checked the rest) and takes
        the run's context; a resumed run's state came with the mechanisms'."""
        self.ledger.ctx = ctx
        if self.ledger.valuing:
            assert ctx.validation_pool is not None
            if (
                self.ledger.config.contribution.metric == "accuracy"
                and ctx.data.task != "classification"
            ):
                raise ConfigError(
                    "contribution.metric: accuracy needs a classification task; use loss"
                )
        per_client = self.ledger.config.incentive.cost.per_client
        if per_client is not None and len(per_client) < len(ctx.train_ids):
            raise ConfigError(
                f"incentive.cost.per_client: {len(per_client)} costs for "
                f"{len(ctx.train_ids)} training clients: give one per client"
            )

    def on_round_end(self, ctx: RunContext, state: RunState, report: RoundReport) -> dict[str, Any]:
        ledger = self.ledger
        if ledger.book is not None and report.results:
            ledger.pay(ctx, report)
        row: dict[str, Any] = {}
        if report.evaluate:
            row = ledger.row()
            ledger.pending = {"contribution": {}, "incentive": {}}
            ledger.pending_seconds = 0.0
        state.mechanisms[STATE_KEY] = ledger.state_dict()  # checkpointed with the run
        return row

    def on_run_end(self, ctx: RunContext, state: RunState) -> dict[str, Any]:
        return self.ledger.summary()


__all__ = [
    "ContributionValuation",
    "IncentiveLedger",
    "IncentivePayments",
    "RoundGame",
    "evaluate_models",
]
