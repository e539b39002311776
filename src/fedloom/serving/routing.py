"""summary.json's ``serving.routing``: every training client's test set answered by its personal
model, by the global model and by the confidence router (serving/router.py), side by side.

The models routed between are the kept best copies when ``serving.keep_best`` is on (each
client's best deployed model, the best global model), else the final ones."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fedloom.engine.serving import ServingCopies
from fedloom.errors import ConfigError
from fedloom.run_config.serving import ServingConfig
from fedloom.serving.router import ClientRouting, route_client

if TYPE_CHECKING:
    from fedloom.engine.loop import Engine
    from fedloom.engine.shell import RunResult


def routing_summary(engine: Engine, result: RunResult, config: ServingConfig) -> dict[str, Any]:
    """Per client and averaged: accuracy of personal, global and routed predictions."""
    copies = next(c for c in engine.callbacks if isinstance(c, ServingCopies))
    kept = copies.state if config.keep_best else {}
    global_model = kept.get("best") or result.global_params
    if global_model is None:
        raise ConfigError(f"serving.route: {engine.algorithm.name} has no global model")
    bests = kept.get("clients_best") or {}
    per_client: dict[int, ClientRouting] = {}
    for cid in engine.train_ids:
        data = engine.data.clients[cid]
        if not data.num_test:
            continue
        personal = bests.get(cid) or result.client_params[cid]
        per_client[cid] = route_client(
            engine.model,
            personal,
            global_model,
            data.x_test,
            data.y_test,
            config.threshold,
            engine.config.eval.batch_size,
        )
    rows = {c: r.as_dict() for c, r in per_client.items()}
    total = sum(r.n for r in per_client.values())
    out: dict[str, Any] = {
        "threshold": config.threshold,
        "models": "best" if config.keep_best else "final",
    }
    for key, count in (
        ("personal", "personal_correct"),
        ("global", "global_correct"),
        ("routed", "routed_correct"),
    ):
        out[key] = {
            "accuracy_mean": sum(r[key] for r in rows.values()) / len(rows),
            "accuracy_pooled": sum(getattr(r, count) for r in per_client.values()) / total,
        }
    out["personal_share"] = sum(r.to_personal for r in per_client.values()) / total
    out["clients"] = {str(c): r for c, r in rows.items()}
    return out


def add_routing(engine: Engine, result: RunResult) -> None:
    """Put ``routing`` into the run's summary (``serving`` section) when it is configured."""
    config = engine.config.serving
    if config.route == "none":
        return
    result.summary.setdefault("serving", {})["routing"] = routing_summary(engine, result, config)
