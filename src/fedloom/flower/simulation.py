"""A fedloom run on Flower's simulation engine: the ServerApp and ClientApp of this package,
one virtual SuperNode per training client, Flower's Ray backend running the ClientApps."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from fedloom.config import RunConfig
from fedloom.engine.shell import RunResult
from fedloom.flower.client import client_app
from fedloom.flower.runtime import ConfigSource, DataFactory, ModelFactory
from fedloom.flower.server import FedloomServer, server_app

log = logging.getLogger(__name__)


def num_supernodes(source: ConfigSource) -> int:
    """One node per training client (held-out new clients never train)."""
    cfg = source.resolve()
    total = source.data().num_clients if source.data is not None else cfg.data.num_clients
    return int(total) - cfg.eval.new_clients


def run_simulation(
    config: RunConfig | Mapping[str, Any] | str | Path | None = None,
    *,
    data: DataFactory | None = None,
    model: ModelFactory | None = None,
    out: str | Path | None = None,
    write: bool = False,
    num_cpus: int | None = None,
    client_cpus: float = 1.0,
    backend_config: dict[str, Any] | None = None,
    verbose: bool = False,
    start_timeout: float = 900.0,
) -> RunResult:
    """Run ``config`` on ``flwr.simulation.run_simulation`` and return fedloom's result (the
    same summary, history and models as ``fedloom.run``; ``summary['executor']`` is
    ``flower``).

    ``num_cpus``: CPUs of the Ray runtime Flower starts (default: all); ``client_cpus``: per
    ClientApp, so ``num_cpus / client_cpus`` clients train at once. ``backend_config`` is
    Flower's (``init_args``, ``client_resources``) and overrides both. Flower shuts Ray down
    at the end, also a Ray runtime that was running before. ``start_timeout``: seconds the
    server waits for the virtual nodes' first answers: they always exist here, but each starts
    a Ray worker that imports torch and loads its data, which on a busy machine took over the
    120 s a deployment's ``connect_timeout`` allows for SuperNodes to appear."""
    from flwr.simulation import run_simulation as flower_simulation

    source = ConfigSource.of(config, data, model)
    nodes = num_supernodes(source)
    backend: dict[str, Any] = {
        "init_args": {"num_cpus": num_cpus or os.cpu_count() or 1, "include_dashboard": False},
        "client_resources": {"num_cpus": client_cpus, "num_gpus": 0.0},
    }
    for key, value in (backend_config or {}).items():
        backend[key] = {**backend.get(key, {}), **value} if isinstance(value, dict) else value
    _warn_if_ray_is_running()
    app = server_app(
        source.raw, data=data, model=model, out=out, write=write, connect_timeout=start_timeout
    )
    server: FedloomServer = app.fedloom_server  # type: ignore[attr-defined]
    flower_simulation(
        server_app=app,
        client_app=client_app(source.raw, data=data, model=model),
        num_supernodes=nodes,
        backend_config=backend,  # type: ignore[arg-type]
        verbose_logging=verbose,
    )
    if server.result is None:
        raise RuntimeError("Flower's simulation ended without a fedloom result (see its log)")
    return server.result


def _warn_if_ray_is_running() -> None:
    try:
        import ray
    except ImportError:  # pragma: no cover - flwr[simulation] depends on it
        return
    if ray.is_initialized():
        log.warning(
            "a Ray runtime is already initialized in this process: Flower's simulation runs "
            "on it and shuts it down when it ends"
        )
