"""What happens around the horizontal round loop, one callback each: evaluation,
training-health monitoring, privacy accounting, secure aggregation's counters, the attack
report, the cold-start curve. The engine calls them in order after every round and at the
start and end of the run (pfl-research's callbacks around a short loop); each reads the
read-only run context and returns the metrics and summary.json entries it adds (the contract:
engine/context.py). The metrics log, trackers, progress bar and checkpoints are the run
shell's, after every callback (engine/shell.py)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from fedloom.attacks.backdoor import backdoor_success
from fedloom.attacks.data import trigger_value
from fedloom.core import pytree
from fedloom.core.protocol import ClientData, ClientTask
from fedloom.core.rng import generator, seed_for
from fedloom.engine.cold_start import adaptation_curve
from fedloom.engine.context import Callback, RunContext
from fedloom.engine.evaluation import evaluate_pooled
from fedloom.engine.metrics import EvalCounts, client_quantiles, pooled
from fedloom.engine.monitoring import (
    HETEROGENEITY_FILE,
    feature_js,
    gradient_dissimilarity,
    label_kl,
    test_samples,
    update_statistics,
)
from fedloom.engine.state import RoundReport, RunState


class Evaluation(Callback):
    """The global model on every client's held-out data (pooled) and each client's deployed
    model on its own (quantiles over clients), on the evaluated rounds."""

    def __init__(self) -> None:
        self.deployed: dict[int, pytree.Tree] = {}
        """Each client's deployed model at the latest evaluation (RunResult.client_params)."""
        self.global_counts: list[EvalCounts] = []
        """The global model on each client's held-out data at the latest evaluation."""

    def on_round_end(self, ctx: RunContext, state: RunState, report: RoundReport) -> dict[str, Any]:
        if not report.evaluate:
            return {}
        row, self.deployed = self.evaluate(ctx, state, report.round)
        return row

    def on_run_end(self, ctx: RunContext, state: RunState) -> dict[str, Any]:
        if not self.deployed:  # resumed at the very end: evaluate once to report client models
            _, self.deployed = self.evaluate(ctx, state, state.round)
        return {}

    def evaluate(
        self, ctx: RunContext, state: RunState, round: int
    ) -> tuple[dict[str, Any], dict[int, pytree.Tree]]:
        algorithm, server, data = ctx.algorithm, state.server, ctx.data
        classification = data.task == "classification"
        batch = ctx.config.eval.batch_size
        row: dict[str, Any] = {"global": None}
        global_model = algorithm.global_model(server)
        global_counts: list[EvalCounts] = []
        if global_model is not None:
            global_counts = evaluate_pooled(ctx.model, *global_model, data.clients, batch)
            row["global"] = pooled(global_counts, classification)
        self.global_counts = global_counts
        deployed: dict[int, pytree.Tree] = {}
        for key, ids in (("personalized", ctx.train_ids), ("new_clients", ctx.new_ids)):
            if not ids:
                continue
            models = self.deployed_models(ctx, state, ids, round)
            for cid, (params, buffers) in zip(ids, models, strict=True):
                deployed[cid] = {**params, **buffers}
            done = self.client_counts(ctx, ids, models, global_model, global_counts)
            row[key] = client_quantiles(done, classification)
            if key == "personalized" and classification:
                row["client_accuracy"] = [c.accuracy if c.n else None for c in done]
        if ctx.validation is not None:
            row["validation"] = self.validate(ctx, global_model, deployed)
        return row, deployed

    @staticmethod
    def deployed_models(
        ctx: RunContext, state: RunState, ids: Sequence[int], round: int
    ) -> list[tuple[pytree.Tree, pytree.Tree]]:
        """The (params, buffers) each of ``ids`` deploys; a client that never trained starts
        from the algorithm's initial client state."""
        algorithm, server, data = ctx.algorithm, state.server, ctx.data
        known = [state.clients.get(c) if c in state.clients else None for c in ids]
        states = [
            s if s is not None else algorithm.init_client_state(server, c)
            for c, s in zip(ids, known, strict=True)
        ]
        tasks = [ClientTask.order(c, data.clients[c], ctx.config.train.lr, round) for c in ids]
        return ctx.executor.deployed_models(algorithm, server, states, tasks)

    @staticmethod
    def client_counts(
        ctx: RunContext,
        ids: Sequence[int],
        models: list[tuple[pytree.Tree, pytree.Tree]],
        global_model: tuple[pytree.Tree, pytree.Tree] | None,
        global_counts: list[EvalCounts],
    ) -> list[EvalCounts]:
        """Each client's deployed model on its own test data; a client that deploys the global
        model itself reuses the global model's evaluation on that client."""
        counts: list[EvalCounts | None] = []
        pending: list[tuple[int, tuple[pytree.Tree, pytree.Tree]]] = []
        for cid, (params, buffers) in zip(ids, models, strict=True):
            if global_model is not None and params is global_model[0]:
                counts.append(global_counts[cid])
            else:
                counts.append(None)
                pending.append((len(counts) - 1, (params, buffers)))
        if pending:
            evaluated = ctx.executor.evaluate(
                [m for _, m in pending],
                [ctx.data.clients[ids[i]] for i, _ in pending],
                ctx.config.eval.batch_size,
            )
            for (i, _), c in zip(pending, evaluated, strict=True):
                counts[i] = c
        return [c for c in counts if c is not None]

    @staticmethod
    def validate(
        ctx: RunContext,
        global_model: tuple[pytree.Tree, pytree.Tree] | None,
        deployed: dict[int, pytree.Tree],
    ) -> dict[str, Any]:
        """The ``validation`` entry (eval.validation_fraction): the global model on all
        validation sets pooled, each training client's deployed model on its own."""
        assert ctx.validation is not None
        classification = ctx.data.task == "classification"
        batch = ctx.config.eval.batch_size
        out: dict[str, Any] = {"global": None}
        ids = [c for c in ctx.train_ids if ctx.validation[c].num_test]
        if global_model is not None:
            counts = evaluate_pooled(
                ctx.model, *global_model, [ctx.validation[c] for c in ids], batch
            )
            out["global"] = pooled(counts, classification)
        keys = set(ctx.model.param_keys)
        models = [
            (
                {k: v for k, v in deployed[c].items() if k in keys},
                {k: v for k, v in deployed[c].items() if k not in keys},
            )
            for c in ids
        ]
        if models:
            counts = ctx.executor.evaluate(models, [ctx.validation[c] for c in ids], batch)
            out["personalized"] = client_quantiles(counts, classification)
        return out


class HealthMonitor(Callback):
    """Training health (docs/monitoring.md; engine/monitoring.py): the clients' label KL,
    feature JS and test-set sizes once (heterogeneity.json), and on evaluated rounds the update
    statistics and the gradient dissimilarity zeta^2 of the global model."""

    def __init__(self) -> None:
        self.heterogeneity: dict[str, Any] | None = None
        self._sample: dict[int, ClientData] | None = None

    def on_run_start(self, ctx: RunContext, state: RunState) -> None:
        clients = dict(enumerate(ctx.data.clients))
        report: dict[str, Any] = {
            "feature_js": feature_js(clients),
            "test_samples": test_samples(clients),
        }
        if ctx.data.task == "classification":
            report["label_kl"] = label_kl(clients, ctx.data.num_outputs)
        if ctx.run_dir is not None:
            ctx.run_dir.write_json(HETEROGENEITY_FILE, report)
        self.heterogeneity = report

    def on_round_end(self, ctx: RunContext, state: RunState, report: RoundReport) -> dict[str, Any]:
        if not report.evaluate:
            return {}
        tick = time.perf_counter()
        deltas = {
            t.client_id: ctx.algorithm.wire.delta(report.message, r)
            for t, r in zip(report.tasks, report.results, strict=True)
        }
        health = update_statistics(
            {c: d for c, d in deltas.items() if d is not None}, ctx.config.monitor.clients
        )
        model = ctx.algorithm.global_model(state.server)
        if ctx.config.monitor.gradient_dissimilarity and model is not None:
            stream = seed_for(ctx.config.seed, "monitor")
            with ctx.model.random_stream(stream, report.round, -1):
                health["zeta2"] = gradient_dissimilarity(ctx.model, *model, self.sample(ctx))
        return {"monitor": health, "seconds": {"monitor": time.perf_counter() - tick}}

    def on_run_end(self, ctx: RunContext, state: RunState) -> dict[str, Any]:
        assert self.heterogeneity is not None

        def mean(values: dict[str, float] | None) -> float | None:
            return sum(values.values()) / len(values) if values else None

        zeta = [r["monitor"]["zeta2"] for r in state.history if "zeta2" in r.get("monitor", {})]
        heterogeneity = {
            "label_kl_mean": mean(self.heterogeneity.get("label_kl")),
            "feature_js_mean": mean(self.heterogeneity.get("feature_js")),
            "zeta2_last": zeta[-1] if zeta else None,
        }
        return {"heterogeneity": heterogeneity}

    def sample(self, ctx: RunContext) -> dict[int, ClientData]:
        """The fixed sample zeta^2 is measured on: up to ``monitor.clients`` training clients,
        each with up to ``monitor.gradient_samples`` of its training samples."""
        if self._sample is None:
            seed, cfg = ctx.config.seed, ctx.config.monitor
            ids = list(ctx.train_ids)
            if len(ids) > cfg.clients:
                order = torch.randperm(len(ids), generator=generator(seed, "monitor"))
                ids = sorted(ids[i] for i in order[: cfg.clients].tolist())
            self._sample = {}
            for c in ids:
                data = ctx.data.clients[c]
                keep = torch.randperm(data.num_train, generator=generator(seed, "monitor", 0, c))
                keep = keep[: cfg.gradient_samples] if cfg.gradient_samples else keep
                self._sample[c] = ClientData(
                    data.x_train[keep], data.y_train[keep], data.x_test[:0], data.y_test[:0]
                )
        return self._sample


class PrivacyAccounting(Callback):
    """The privacy budget spent so far on the evaluated rounds' rows (``privacy``), from the
    first of ``sources`` that accounts for one (a method ``privacy_spent() -> {'epsilon':
    ..., 'delta': ...}``): the slot differential privacy fills."""

    def __init__(self, sources: list[Any]) -> None:
        self.sources = sources

    def on_round_end(self, ctx: RunContext, state: RunState, report: RoundReport) -> dict[str, Any]:
        if not report.evaluate:
            return {}
        for source in self.sources:
            spent = getattr(source, "privacy_spent", None)
            if callable(spent):
                return {"privacy": dict(spent())}
        return {}


class SecureAggregationLog(Callback):
    """Secure aggregation's counters on the evaluated rounds' rows (``secure_aggregation``):
    rounds completed and aborted, protocol bytes, the latest round."""

    def __init__(self, secure: Any) -> None:
        self.secure = secure

    def on_round_end(self, ctx: RunContext, state: RunState, report: RoundReport) -> dict[str, Any]:
        return {"secure_aggregation": self.secure.progress()} if report.evaluate else {}


class AttackReport(Callback):
    """Under a poisoning attack, on the evaluated rounds' rows (``attack``): the benign
    clients' accuracy apart from the malicious ones', for the global model on their pooled
    held-out data and for their deployed models (mean), and for a backdoor its success rate on
    the global model (engine/mechanisms.py; attacks/)."""

    def __init__(self, mechanisms: Any) -> None:
        self.malicious = set(mechanisms.malicious)
        self.attack = mechanisms.config.attack
        self.last: dict[str, Any] = {}

    def on_round_end(self, ctx: RunContext, state: RunState, report: RoundReport) -> dict[str, Any]:
        if not report.evaluate:
            return {}
        classification = ctx.data.task == "classification"
        benign = [c for c in ctx.train_ids if c not in self.malicious]
        row: dict[str, Any] = {"malicious": len(self.malicious)}
        counts = ctx.evaluation.global_counts
        if counts:
            row["benign_global"] = pooled([counts[c] for c in benign], classification)
        accuracy = report.metrics.get("client_accuracy")
        if accuracy and len(accuracy) == len(ctx.train_ids):
            by_client = dict(zip(ctx.train_ids, accuracy, strict=True))
            for name, ids in (("benign", benign), ("malicious", sorted(self.malicious))):
                values = [by_client[c] for c in ids if by_client[c] is not None]
                row[f"{name}_personalized_mean"] = sum(values) / len(values) if values else None
        global_model = ctx.algorithm.global_model(state.server)
        if self.attack.kind == "backdoor" and global_model is not None:
            trigger = self.attack.trigger
            value = trigger.value if trigger.value is not None else trigger_value(ctx.data)
            row["backdoor_success"] = backdoor_success(
                ctx.model,
                *global_model,
                [ctx.data.clients[c] for c in benign],
                self.attack.target,
                trigger.size,
                value,
            )
        self.last = row
        return {"attack": row}

    def on_run_end(self, ctx: RunContext, state: RunState) -> dict[str, Any]:
        return {"final": {"attack": self.last}} if self.last else {}


class ColdStart(Callback):
    """Accuracy of the held-out new clients vs fine-tuning steps (engine/cold_start.py), into
    summary.json's ``cold_start``."""

    def on_run_end(self, ctx: RunContext, state: RunState) -> dict[str, Any]:
        if not ctx.new_ids:
            return {}
        cfg, algorithm = ctx.config, ctx.algorithm
        lr = cfg.eval.adapt_lr or algorithm.deployment.adaptation_lr() or cfg.train.lr
        curve = adaptation_curve(
            algorithm,
            state.server,
            {c: ctx.data.clients[c] for c in ctx.new_ids},
            cfg.eval.adaptation_steps,
            lr,
            cfg.train.rounds,
            cfg.eval.batch_size,
            ctx.data.task == "classification",
            batched=ctx.executor.batches_clients,
        )
        return {"cold_start": curve}
