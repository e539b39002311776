"""Deployable copies kept while a run trains (two copies: the best-on-validation checkpoint and
an EMA-smoothed model; docs/serving.md): the global model of the round with the best validation
metric, each client's best deployed model when clients deploy models of their own, and an
exponential moving average (EMA) of the global model.

The EMA starts at zero and is debiased as Adam's moments are (Kingma & Ba, ICLR 2015, Sec. 3):
after t rounds, ``ema_t = d ema_{t-1} + (1 - d) w_t`` and the copy served is
``ema_t / (1 - d^t)``, the weighted mean of w_1..w_t with weights proportional to d^(t-s),
so the initial model never leaks in. Integer buffers (BatchNorm's batch counter) are copied,
not averaged.

The copies live in ``RunState.serving``, so checkpoints hold them and a resumed run keeps
exactly what the uninterrupted one keeps; at the end of a run with a directory they are
written to ``RUN_DIR/serving/`` as safetensors, with ``serving.json`` describing them
(what ``fedloom export`` reads).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file

from fedloom.core import pytree
from fedloom.core.files import strict_json
from fedloom.core.runpaths import under, write_text_atomic
from fedloom.engine.context import Callback, RunContext
from fedloom.engine.metrics import EvalCounts, client_quantiles, pooled
from fedloom.errors import ConfigError
from fedloom.run_config.serving import ServingConfig

if TYPE_CHECKING:
    from fedloom.engine.state import RoundReport, RunState

SERVING_DIR = "serving"
META_FILE = "serving.json"
FILES = {
    "global": "global.safetensors",
    "ema": "ema.safetensors",
    "best": "best.safetensors",
    "clients": "clients.safetensors",
    "clients_best": "clients_best.safetensors",
}
"""What ``RUN_DIR/serving/`` holds (the client files key each tensor ``CLIENT/NAME``)."""


def _copy(tree: pytree.Tree) -> pytree.Tree:
    return {k: v.detach().clone() for k, v in tree.items()}


def ema_update(ema: pytree.Tree | None, model: pytree.Tree, decay: float) -> pytree.Tree:
    """One step of the (zero-started) moving average; integer tensors take the new value."""
    out = {}
    for key, value in model.items():
        if not value.is_floating_point():
            out[key] = value.detach().clone()
            continue
        previous = ema[key] if ema is not None else torch.zeros_like(value)
        out[key] = decay * previous + (1.0 - decay) * value.detach()
    return out


def ema_debiased(ema: pytree.Tree, decay: float, steps: int) -> pytree.Tree:
    """The served EMA: ``ema / (1 - decay^steps)`` (float tensors)."""
    scale = 1.0 / (1.0 - decay**steps)
    return {k: v * scale if v.is_floating_point() else v.clone() for k, v in ema.items()}


class ServingCopies(Callback):
    """Keeps the best and EMA copies every round (after evaluation, before checkpointing)."""

    def __init__(self, config: ServingConfig) -> None:
        self.config = config
        self.state: dict[str, Any] = {}
        """ema, ema_steps, best, best_round, best_value, clients_best, clients_best_round,
        clients_best_value: checkpointed as ``RunState.serving``."""
        self.maximize = True
        self.key = "accuracy"

    # -- hooks ------------------------------------------------------------------------------
    def on_run_start(self, ctx: RunContext, state: RunState) -> None:
        classification = ctx.data.task == "classification"
        self.maximize, self.key = (True, "accuracy") if classification else (False, "loss")
        self.state = dict(state.serving)  # a resumed run continues from its checkpoint
        if self.config.route == "confidence":
            check_routable(ctx)

    def on_round_end(self, ctx: RunContext, state: RunState, report: RoundReport) -> dict[str, Any]:
        model = ctx.algorithm.global_model(state.server)
        merged = {**model[0], **model[1]} if model is not None else None
        s = self.state
        if self.config.ema is not None and merged is not None:
            s["ema"] = ema_update(s.get("ema"), merged, self.config.ema)
            s["ema_steps"] = s.get("ema_steps", 0) + 1
        if self.config.keep_best and report.evaluate:
            validation = report.metrics.get("validation") or {}
            value = (validation.get("global") or {}).get(self.key)
            if (
                merged is not None
                and value is not None
                and self._better(value, s.get("best_value"))
            ):
                s.update(best=_copy(merged), best_round=report.round, best_value=value)
            self._keep_client_bests(ctx, model, report.round)
        state.serving = s
        return {}

    def on_run_end(self, ctx: RunContext, state: RunState) -> dict[str, Any]:
        summary = self.summary(ctx, state)
        if ctx.run_dir is not None:
            self.write(ctx, state, ctx.run_dir.file(SERVING_DIR), summary)
        return {"serving": summary}

    # -- the copies -----------------------------------------------------------------------
    def _better(self, value: float, best: float | None) -> bool:
        if best is None:
            return True
        return value > best if self.maximize else value < best

    def _keep_client_bests(
        self, ctx: RunContext, model: tuple[pytree.Tree, pytree.Tree] | None, round: int
    ) -> None:
        """Each client's deployed model when it beats that client's best on its own
        validation set (clients that deploy the global model have only the global best)."""
        deployed = ctx.evaluation.deployed
        assert ctx.validation is not None
        ids = [c for c in personal_clients(deployed, model) if ctx.validation[c].num_test]
        if not ids:
            return
        keys = set(ctx.model.param_keys)
        models = [
            (
                {k: v for k, v in deployed[c].items() if k in keys},
                {k: v for k, v in deployed[c].items() if k not in keys},
            )
            for c in ids
        ]
        counts = ctx.executor.evaluate(
            models, [ctx.validation[c] for c in ids], ctx.config.eval.batch_size
        )
        s = self.state
        bests = s.setdefault("clients_best", {})
        values = s.setdefault("clients_best_value", {})
        rounds = s.setdefault("clients_best_round", {})
        for cid, count in zip(ids, counts, strict=True):
            value = count.accuracy if self.maximize else count.loss
            if value is not None and self._better(value, values.get(cid)):
                bests[cid], values[cid], rounds[cid] = _copy(deployed[cid]), value, round

    def copies(self) -> dict[str, pytree.Tree | None]:
        """The served global copies: ``ema`` (debiased) and ``best`` (None where not kept)."""
        s = self.state
        ema = s.get("ema")
        return {
            "ema": ema_debiased(ema, self.config.ema, s["ema_steps"]) if ema is not None else None,
            "best": s.get("best"),
        }

    # -- summary and files ----------------------------------------------------------------
    def summary(self, ctx: RunContext, state: RunState) -> dict[str, Any]:
        """summary.json's ``serving``: each kept copy with its round and test metrics (the
        global copies on the clients' pooled test sets, the client copies each on its own)."""
        classification = ctx.data.task == "classification"
        batch = ctx.config.eval.batch_size
        keys = set(ctx.model.param_keys)

        def on_test(tree: pytree.Tree) -> dict[str, float | None]:
            params = {k: v for k, v in tree.items() if k in keys}
            buffers = {k: v for k, v in tree.items() if k not in keys}
            counts = [
                EvalCounts(*ctx.model.evaluate(params, buffers, c.x_test, c.y_test, batch))
                for c in (ctx.data.clients[i] for i in ctx.train_ids)
            ]
            return pooled(counts, classification)

        s, out = self.state, {"metric": f"validation.global.{self.key}"}
        copies = self.copies()
        if copies["ema"] is not None:
            out["ema"] = {
                "decay": self.config.ema,
                "steps": s["ema_steps"],
                "test": on_test(copies["ema"]),
            }
        if copies["best"] is not None:
            out["best"] = {
                "round": s["best_round"],
                "validation": s["best_value"],
                "test": on_test(copies["best"]),
            }
        if s.get("clients_best"):
            bests = s["clients_best"]
            ids = sorted(bests)
            models = [
                (
                    {k: v for k, v in bests[c].items() if k in keys},
                    {k: v for k, v in bests[c].items() if k not in keys},
                )
                for c in ids
            ]
            counts = ctx.executor.evaluate(models, [ctx.data.clients[c] for c in ids], batch)
            out["clients_best"] = {
                "rounds": {str(c): s["clients_best_round"][c] for c in ids},
                "test": client_quantiles(counts, classification),
            }
        return out

    def write(self, ctx: RunContext, state: RunState, folder: Path, served: dict[str, Any]) -> None:
        """``serving/``: the final global and client models, the kept copies, serving.json
        (``served``: summary.json's ``serving``). ``folder`` is RUN/serving, checked: each file
        in it is named through ``under`` (core/runpaths.py), so a link there is refused."""
        folder.mkdir(parents=True, exist_ok=True)
        model = ctx.algorithm.global_model(state.server)
        deployed = ctx.evaluation.deployed
        personal = personal_clients(deployed, model)  # the others deploy the global model
        trees: dict[str, dict[str, torch.Tensor] | None] = {
            "global": {**model[0], **model[1]} if model is not None else None,
            **self.copies(),
            "clients": _by_client({c: deployed[c] for c in personal}) if personal else None,
            "clients_best": _by_client(self.state["clients_best"])
            if self.state.get("clients_best")
            else None,
        }
        written = {}
        for name, tree in trees.items():
            if tree is not None:
                save_file(
                    {k: v.detach().cpu().contiguous().clone() for k, v in tree.items()},
                    under(folder, FILES[name]),
                )
                written[name] = FILES[name]
        meta = {
            "format": "fedloom-serving",
            "version": 1,
            "task": ctx.data.task,
            "input_shape": list(ctx.data.input_shape),
            "num_outputs": ctx.data.num_outputs,
            "model": ctx.config.model.name,
            "param_keys": list(ctx.model.param_keys),
            "buffer_keys": list(ctx.model.buffer_keys),
            "rounds": state.round,
            "files": written,
            "clients": sorted(deployed),
            "personal": personal,
            "serving": served,
        }
        write_text_atomic(under(folder, META_FILE), strict_json(meta, indent=2))


def check_routable(ctx: RunContext) -> None:
    """Routing compares softmax confidences with a global model's: checked before round 1."""
    if ctx.data.task != "classification":
        raise ConfigError(
            "serving.route: confidence routes by softmax confidence: classification only "
            f"({ctx.data.name} is {ctx.data.task})"
        )
    if not ctx.algorithm.capabilities.has_global_model:
        raise ConfigError(
            f"serving.route: confidence routes to the global model; {ctx.algorithm.name} has none"
        )


def personal_clients(
    deployed: dict[int, pytree.Tree], model: tuple[pytree.Tree, pytree.Tree] | None
) -> list[int]:
    """The clients whose deployed model is not the global model itself."""
    if model is None:
        return sorted(deployed)
    params = model[0]
    first = next(iter(params))
    return sorted(c for c, tree in deployed.items() if tree.get(first) is not params[first])


def _by_client(trees: dict[int, pytree.Tree]) -> dict[str, torch.Tensor]:
    return {f"{cid}/{k}": v for cid, tree in trees.items() for k, v in tree.items()}
