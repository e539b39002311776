"""What happens around the round loop, one callback each: evaluation, training-health
monitoring, privacy accounting, the metrics log (metrics.jsonl, trackers, progress), checkpoints,
the cold-start curve. The engine calls them in order after every round and at the start and end
of the run (pfl-research's callbacks around a short loop)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import torch

from fedloom.attacks.backdoor import backdoor_success
from fedloom.attacks.data import trigger_value
from fedloom.core import pytree
from fedloom.core.protocol import ClientData, ClientTask
from fedloom.core.rng import generator, seed_for
from fedloom.engine.cold_start import adaptation_curve
from fedloom.engine.evaluation import evaluate_pooled
from fedloom.engine.metrics import EvalCounts, client_quantiles, pooled
from fedloom.engine.monitoring import (
    HETEROGENEITY_FILE,
    feature_js,
    gradient_dissimilarity,
    label_kl,
    update_statistics,
)
from fedloom.engine.progress import RoundProgress
from fedloom.engine.state import RoundReport, RunState
from fedloom.engine.tracking import Tracker, make_trackers

if TYPE_CHECKING:
    from fedloom.engine.loop import Engine


class Callback:
    """Hooks around the round loop; each does nothing unless overridden."""

    def on_run_start(self, engine: Engine, state: RunState) -> None:
        pass

    def on_round_end(self, engine: Engine, state: RunState, report: RoundReport) -> None:
        pass

    def on_run_end(self, engine: Engine, state: RunState, summary: dict[str, Any]) -> None:
        pass

    def on_failure(self, engine: Engine) -> None:
        """The run stopped on an error (after ``on_run_start``)."""


class Evaluation(Callback):
    """The global model on every client's held-out data (pooled) and each client's deployed
    model on its own (quantiles over clients), on the evaluated rounds."""

    def __init__(self) -> None:
        self.deployed: dict[int, pytree.Tree] = {}
        """Each client's deployed model at the latest evaluation (RunResult.client_params)."""
        self.global_counts: list[EvalCounts] = []
        """The global model on each client's held-out data at the latest evaluation."""

    def on_round_end(self, engine: Engine, state: RunState, report: RoundReport) -> None:
        if report.evaluate:
            row, self.deployed = self.evaluate(engine, state, report.round)
            report.metrics.update(row)

    def on_run_end(self, engine: Engine, state: RunState, summary: dict[str, Any]) -> None:
        if not self.deployed:  # resumed at the very end: evaluate once to report client models
            _, self.deployed = self.evaluate(engine, state, state.round)

    def evaluate(
        self, engine: Engine, state: RunState, round: int
    ) -> tuple[dict[str, Any], dict[int, pytree.Tree]]:
        algorithm, server, data = engine.algorithm, state.server, engine.data
        classification = data.task == "classification"
        batch = engine.config.eval.batch_size
        row: dict[str, Any] = {"global": None}
        global_model = algorithm.global_model(server)
        global_counts: list[EvalCounts] = []
        if global_model is not None:
            global_counts = evaluate_pooled(engine.model, *global_model, data.clients, batch)
            row["global"] = pooled(global_counts, classification)
        self.global_counts = global_counts
        deployed: dict[int, pytree.Tree] = {}
        for key, ids in (("personalized", engine.train_ids), ("new_clients", engine.new_ids)):
            if not ids:
                continue
            counts: list[EvalCounts | None] = []
            pending: list[tuple[int, tuple[pytree.Tree, pytree.Tree]]] = []
            known = [state.clients.get(c) if c in state.clients else None for c in ids]
            states = [
                s if s is not None else algorithm.init_client_state(server, c)
                for c, s in zip(ids, known, strict=True)
            ]
            tasks = [ClientTask(c, data.clients[c], [], engine.config.train.lr, round) for c in ids]
            models = engine.executor.deployed_models(algorithm, server, states, tasks)
            for cid, (params, buffers) in zip(ids, models, strict=True):
                deployed[cid] = {**params, **buffers}
                if global_model is not None and params is global_model[0]:
                    counts.append(global_counts[cid])  # deploys the global model: evaluated
                else:
                    counts.append(None)
                    pending.append((len(counts) - 1, (params, buffers)))
            if pending:
                evaluated = engine.executor.evaluate(
                    [m for _, m in pending], [data.clients[ids[i]] for i, _ in pending], batch
                )
                for (i, _), c in zip(pending, evaluated, strict=True):
                    counts[i] = c
            done = [c for c in counts if c is not None]
            row[key] = client_quantiles(done, classification)
            if key == "personalized" and classification:
                row["client_accuracy"] = [c.accuracy if c.n else None for c in done]
        if engine.validation is not None:
            row["validation"] = self.validate(engine, global_model, deployed)
        return row, deployed

    @staticmethod
    def validate(
        engine: Engine,
        global_model: tuple[pytree.Tree, pytree.Tree] | None,
        deployed: dict[int, pytree.Tree],
    ) -> dict[str, Any]:
        """The ``validation`` entry (eval.validation_fraction): the global model on all
        validation sets pooled, each training client's deployed model on its own."""
        assert engine.validation is not None
        classification = engine.data.task == "classification"
        batch = engine.config.eval.batch_size
        out: dict[str, Any] = {"global": None}
        ids = [c for c in engine.train_ids if engine.validation[c].num_test]
        if global_model is not None:
            counts = evaluate_pooled(
                engine.model, *global_model, [engine.validation[c] for c in ids], batch
            )
            out["global"] = pooled(counts, classification)
        keys = set(engine.model.param_keys)
        models = [
            (
                {k: v for k, v in deployed[c].items() if k in keys},
                {k: v for k, v in deployed[c].items() if k not in keys},
            )
            for c in ids
        ]
        if models:
            counts = engine.executor.evaluate(models, [engine.validation[c] for c in ids], batch)
            out["personalized"] = client_quantiles(counts, classification)
        return out


class HealthMonitor(Callback):
    """Training health (docs/monitoring.md; engine/monitoring.py): the clients' label KL and
    feature JS once (heterogeneity.json), and on evaluated rounds the update statistics and
    the gradient dissimilarity zeta^2 of the global model."""

    def __init__(self) -> None:
        self.heterogeneity: dict[str, Any] | None = None
        self._sample: dict[int, ClientData] | None = None

    def on_run_start(self, engine: Engine, state: RunState) -> None:
        clients = dict(enumerate(engine.data.clients))
        report: dict[str, Any] = {"feature_js": feature_js(clients)}
        if engine.data.task == "classification":
            report["label_kl"] = label_kl(clients, engine.data.num_outputs)
        if engine.run_dir is not None:
            engine.run_dir.write_json(HETEROGENEITY_FILE, report)
        self.heterogeneity = report

    def on_round_end(self, engine: Engine, state: RunState, report: RoundReport) -> None:
        if not report.evaluate:
            return
        tick = time.perf_counter()
        deltas = {
            t.client_id: engine.algorithm.client_delta(report.message, r)
            for t, r in zip(report.tasks, report.results, strict=True)
        }
        health = update_statistics(
            {c: d for c, d in deltas.items() if d is not None}, engine.config.monitor.clients
        )
        model = engine.algorithm.global_model(state.server)
        if engine.config.monitor.gradient_dissimilarity and model is not None:
            stream = seed_for(engine.config.seed, "monitor")
            with engine.model.random_stream(stream, report.round, -1):
                health["zeta2"] = gradient_dissimilarity(engine.model, *model, self.sample(engine))
        report.metrics["monitor"] = health
        report.monitor_seconds += time.perf_counter() - tick

    def on_run_end(self, engine: Engine, state: RunState, summary: dict[str, Any]) -> None:
        assert self.heterogeneity is not None

        def mean(values: dict[str, float] | None) -> float | None:
            return sum(values.values()) / len(values) if values else None

        zeta = [r["monitor"]["zeta2"] for r in state.history if "zeta2" in r.get("monitor", {})]
        summary["heterogeneity"] = {
            "label_kl_mean": mean(self.heterogeneity.get("label_kl")),
            "feature_js_mean": mean(self.heterogeneity.get("feature_js")),
            "zeta2_last": zeta[-1] if zeta else None,
        }

    def sample(self, engine: Engine) -> dict[int, ClientData]:
        """The fixed sample zeta^2 is measured on: up to ``monitor.clients`` training clients,
        each with up to ``monitor.gradient_samples`` of its training samples."""
        if self._sample is None:
            seed, cfg = engine.config.seed, engine.config.monitor
            ids = list(engine.train_ids)
            if len(ids) > cfg.clients:
                order = torch.randperm(len(ids), generator=generator(seed, "monitor"))
                ids = sorted(ids[i] for i in order[: cfg.clients].tolist())
            self._sample = {}
            for c in ids:
                data = engine.data.clients[c]
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

    def on_round_end(self, engine: Engine, state: RunState, report: RoundReport) -> None:
        if not report.evaluate:
            return
        for source in self.sources:
            spent = getattr(source, "privacy_spent", None)
            if callable(spent):
                report.metrics["privacy"] = dict(spent())
                return


class SecureAggregationLog(Callback):
    """Secure aggregation's counters on the evaluated rounds' rows (``secure_aggregation``):
    rounds completed and aborted, protocol bytes, the latest round."""

    def __init__(self, secure: Any) -> None:
        self.secure = secure

    def on_round_end(self, engine: Engine, state: RunState, report: RoundReport) -> None:
        if report.evaluate:
            report.metrics["secure_aggregation"] = self.secure.progress()


class AttackReport(Callback):
    """Under a poisoning attack, on the evaluated rounds' rows (``attack``): the benign
    clients' accuracy apart from the malicious ones', for the global model on their pooled
    held-out data and for their deployed models (mean), and for a backdoor its success rate on
    the global model (engine/mechanisms.py; attacks/)."""

    def __init__(self, mechanisms: Any) -> None:
        self.malicious = set(mechanisms.malicious)
        self.attack = mechanisms.config.attack
        self.last: dict[str, Any] = {}

    def on_round_end(self, engine: Engine, state: RunState, report: RoundReport) -> None:
        if not report.evaluate:
            return
        classification = engine.data.task == "classification"
        benign = [c for c in engine.train_ids if c not in self.malicious]
        row: dict[str, Any] = {"malicious": len(self.malicious)}
        counts = engine.evaluation.global_counts
        if counts:
            row["benign_global"] = pooled([counts[c] for c in benign], classification)
        accuracy = report.metrics.get("client_accuracy")
        if accuracy and len(accuracy) == len(engine.train_ids):
            by_client = dict(zip(engine.train_ids, accuracy, strict=True))
            for name, ids in (("benign", benign), ("malicious", sorted(self.malicious))):
                values = [by_client[c] for c in ids if by_client[c] is not None]
                row[f"{name}_personalized_mean"] = sum(values) / len(values) if values else None
        global_model = engine.algorithm.global_model(state.server)
        if self.attack.kind == "backdoor" and global_model is not None:
            trigger = self.attack.trigger
            value = trigger.value if trigger.value is not None else trigger_value(engine.data)
            row["backdoor_success"] = backdoor_success(
                engine.model,
                *global_model,
                [engine.data.clients[c] for c in benign],
                self.attack.target,
                trigger.size,
                value,
            )
        report.metrics["attack"] = row
        self.last = row

    def on_run_end(self, engine: Engine, state: RunState, summary: dict[str, Any]) -> None:
        if self.last:
            summary["final"]["attack"] = self.last


class MetricsLog(Callback):
    """The evaluated rounds' rows: into the history, metrics.jsonl, the trackers (TensorBoard,
    MLflow) and the progress bar."""

    def __init__(self, progress: bool) -> None:
        self.progress = progress
        self.trackers: list[Tracker] = []
        self.bar: RoundProgress | None = None
        self._start = 0.0

    def on_run_start(self, engine: Engine, state: RunState) -> None:
        cfg, run_dir = engine.config, engine.run_dir
        name = run_dir.path.name if run_dir else f"{engine.algorithm.name}-{engine.data.name}"
        self.trackers = make_trackers(cfg, run_dir.path if run_dir else None, name)
        self.bar = RoundProgress(cfg.train.rounds, state.round, enabled=self.progress)
        self.bar.__enter__()
        self._start = time.perf_counter() - state.elapsed

    def on_round_end(self, engine: Engine, state: RunState, report: RoundReport) -> None:
        assert self.bar is not None
        state.elapsed = time.perf_counter() - self._start
        if report.evaluate:
            row = self.row(state, report)
            state.history.append(row)
            if engine.run_dir:
                engine.run_dir.append_metrics(row)
            for tracker in self.trackers:
                tracker.log(row)
            self.bar.show_metrics(row)
        self.bar.advance()

    @staticmethod
    def row(state: RunState, report: RoundReport) -> dict[str, Any]:
        info = report.client_info()
        measured = dict(report.metrics)
        timed = measured.pop("seconds", {})  # callbacks' own timings (contribution evaluation)
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
                "monitor": report.monitor_seconds,
                **timed,
            },
        }

    def on_run_end(self, engine: Engine, state: RunState, summary: dict[str, Any]) -> None:
        self._close()
        for tracker in self.trackers:
            tracker.close(summary)
        self.trackers = []

    def on_failure(self, engine: Engine) -> None:
        self._close()
        for tracker in self.trackers:  # a run that failed: close them as such
            tracker.close(None, failed=True)
        self.trackers = []

    def _close(self) -> None:
        if self.bar is not None:
            self.bar.__exit__(None, None, None)
            self.bar = None


class Checkpointing(Callback):
    """The run state every ``checkpoint.every`` rounds and after the last one (run
    directories only; engine/checkpoint.py writes it)."""

    def on_round_end(self, engine: Engine, state: RunState, report: RoundReport) -> None:
        every, run_dir = engine.config.checkpoint.every, engine.run_dir
        last = report.round == engine.config.train.rounds
        if run_dir and every and (report.round % every == 0 or last):
            state.executor_choice = getattr(engine.executor, "choice", None)
            run_dir.save_checkpoint(report.round, state.checkpoint(), engine.config.checkpoint.keep)


class ColdStart(Callback):
    """Accuracy of the held-out new clients vs fine-tuning steps (engine/cold_start.py), into
    summary.json's ``cold_start``."""

    def on_run_end(self, engine: Engine, state: RunState, summary: dict[str, Any]) -> None:
        if not engine.new_ids:
            return
        cfg, algorithm = engine.config, engine.algorithm
        lr = cfg.eval.adapt_lr or algorithm.adaptation_lr() or cfg.train.lr
        summary["cold_start"] = adaptation_curve(
            algorithm,
            state.server,
            {c: engine.data.clients[c] for c in engine.new_ids},
            cfg.eval.adaptation_steps,
            lr,
            cfg.train.rounds,
            cfg.eval.batch_size,
            engine.data.task == "classification",
            batched=engine.executor.batches_clients,
        )
