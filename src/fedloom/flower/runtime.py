"""The run both sides of a Flower app build from the same fedloom config: the config itself
(with the Flower run's overrides), and on a client node the engine's algorithm, data and plans.

Both the ServerApp and every ClientApp parse the same config and load the same federated
dataset, so they derive the same partition, model, algorithm context and random streams
(seed, round, client, purpose): what makes a Flower run equal fedloom's own engine run.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from fedloom.config import DEFAULT_EXPERIMENT, RunConfig, apply_overrides, load_yaml, parse_config
from fedloom.core.protocol import ClientTask
from fedloom.data import FederatedData, load_dataset
from fedloom.engine.loop import Engine
from fedloom.engine.sequential import SequentialExecutor
from fedloom.engine.threads import run_threads
from fedloom.errors import ConfigError
from fedloom.horizontal import resolve_defaults
from fedloom.peft import build_run_model

RUN_CONFIG_PREFIX = "fedloom."
"""Keys of a Flower run config (``[tool.flwr.app.config]``, ``flwr run --run-config``) that
start with it override the fedloom config: ``fedloom.train.rounds = 5`` is ``--set
train.rounds=5``."""

DataFactory = Callable[[], FederatedData]
ModelFactory = Callable[[], nn.Module]


@dataclass(frozen=True)
class ConfigSource:
    """A fedloom config as plain data (small and picklable: Flower's simulation ships the
    ClientApp to its Ray actors with every message), plus optional factories of the user's own
    data and model (zero-argument callables, called once per process)."""

    raw: dict[str, Any]
    data: DataFactory | None = None
    model: ModelFactory | None = None
    written_in: str | None = "the config"
    """Where ``raw`` was written; None for the embedded default experiment (an override of
    its algorithm, dataset or partition replaces that choice's keys: config.apply_overrides)."""

    @classmethod
    def of(
        cls,
        config: RunConfig | Mapping[str, Any] | str | Path | None,
        data: DataFactory | None = None,
        model: ModelFactory | None = None,
    ) -> ConfigSource:
        written_in: str | None = "the config"
        if isinstance(config, RunConfig):
            raw = config.to_dict()
        elif isinstance(config, str | Path):
            raw, written_in = load_yaml(config), str(config)
        elif config is None:
            raw, written_in = DEFAULT_EXPERIMENT, None
        else:
            raw = dict(config)
        from fedloom.vertical.config import is_vertical_config

        if is_vertical_config(raw):
            raise ConfigError(
                "data.partition.kind: vertical runs have their own protocol "
                "(docs/vertical.md); the Flower adapter runs horizontal FL"
            )
        for name, factory in (("data", data), ("model", model)):
            if factory is not None and not callable(factory):
                raise ConfigError(
                    f"fedloom.flower: {name} must be a zero-argument callable that returns the "
                    f"{name} (it is called once per process), got {type(factory).__name__}"
                )
        return cls(json.loads(json.dumps(raw)), data, model, written_in)

    def resolve(self, run_config: Mapping[str, Any] | None = None) -> RunConfig:
        """The parsed config, with the ``fedloom.``-prefixed keys of the Flower run config
        applied as ``--set`` overrides and the dataset's defaults filled in."""
        overrides = [
            f"{key[len(RUN_CONFIG_PREFIX) :]}={json.dumps(value)}"
            for key, value in sorted((run_config or {}).items())
            if key.startswith(RUN_CONFIG_PREFIX)
        ]
        cfg = parse_config(apply_overrides(self.raw, overrides, self.written_in))
        return resolve_defaults(cfg, custom_data=self.data is not None)

    def key(self, run_config: Mapping[str, Any] | None) -> str:
        """Identifies the run a process builds (its cache key)."""
        names = [getattr(f, "__qualname__", repr(f)) for f in (self.data, self.model)]
        return json.dumps(
            [self.raw, self.written_in, dict(run_config or {}), names], sort_keys=True, default=str
        )

    def build_engine(self, run_config: Mapping[str, Any] | None = None) -> Engine:
        """fedloom's engine for the run (what ``fedloom.run`` builds), without a run directory."""
        cfg = self.resolve(run_config)
        data = self.data() if self.data is not None else load_dataset(cfg.data, cfg.seed)
        module = (
            self.model()
            if self.model is not None
            else build_run_model(cfg, data.input_shape, data.num_outputs)
        )
        return Engine(cfg, data, module)

    def load_data(self) -> FederatedData | None:
        """The user's data (None: the configured dataset, loaded by ``fedloom.run``)."""
        return self.data() if self.data is not None else None

    def load_model(self) -> nn.Module | None:
        """The user's model (None: the configured one, built by ``fedloom.run``)."""
        return self.model() if self.model is not None else None


class ClientRuntime:
    """What a client node needs to run its rounds: the run's engine (algorithm and context,
    training data views, plan maker) and the sequential executor (one client, fedloom's
    sequential solver)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.executor = SequentialExecutor(engine.model)
        self.threads = self._threads()

    def _threads(self) -> int | None:
        """The node's intra-op threads: those of a sequential fedloom run of the config
        (``executor.threads``, else 1 for a small step, else the node's cores), so a node trains
        as the engine's sequential executor does."""
        engine = self.engine
        sequential = engine.config.executor.model_copy(
            update={"kind": "sequential", "workers": None}
        )
        biggest = max(engine.data.clients, key=lambda c: c.num_train)
        batch = engine.config.train.batch_size or biggest.num_train
        return run_threads(sequential, engine.model.module, biggest.x_train[0], batch)

    def task(self, client: int, round: int, steps: int, full: int | None) -> ClientTask:
        """The client's work order for ``round``, as the engine's ``tasks_for_round`` made it on
        the server: ``steps`` minibatches drawn from the (seed, round, client, "batches")
        stream (the server decides ``steps``: stragglers depend on the whole round)."""
        engine = self.engine
        if client not in engine.training.data:
            raise ConfigError(
                f"fedloom.flower: client {client} is not a training client of this run "
                f"(training clients: 0..{len(engine.train_ids) - 1})"
            )
        data = engine.training.data[client]
        make_plan = engine.algorithm.ctx.make_plan
        return ClientTask.order(client, data, engine.config.train.lr, round, make_plan, steps, full)


_RUNTIMES: dict[str, ClientRuntime] = {}
"""This process's client runtimes by run (a Ray actor of the simulation serves many nodes)."""


def client_runtime(source: ConfigSource, run_config: Mapping[str, Any] | None) -> ClientRuntime:
    key = source.key(run_config)
    if key not in _RUNTIMES:
        _RUNTIMES.clear()  # one run at a time per process: free the previous run's data
        _RUNTIMES[key] = ClientRuntime(source.build_engine(run_config))
    return _RUNTIMES[key]
