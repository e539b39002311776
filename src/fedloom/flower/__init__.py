"""Run any fedloom algorithm as a Flower app (docs/flower.md): ``server_app(config)`` is a Flower
``ServerApp`` running fedloom's round loop, ``client_app(config)`` the ``ClientApp`` of every
node (node ``partition-id`` K trains fedloom client K), ``run_simulation(config)`` runs both on
Flower's simulation engine. Needs the optional extra: ``pip install 'fedloom[flower]'``.
"""

from __future__ import annotations

from importlib.util import find_spec

from fedloom.errors import ConfigError

if find_spec("flwr") is None:  # pragma: no cover - depends on the environment
    raise ConfigError(
        "fedloom.flower needs Flower, an optional extra that is not installed: "
        "pip install 'fedloom[flower]'"
    )

from fedloom.flower.client import client_app
from fedloom.flower.server import FlowerError, FlowerExecutor, server_app
from fedloom.flower.simulation import run_simulation

__all__ = ["FlowerError", "FlowerExecutor", "client_app", "run_simulation", "server_app"]
