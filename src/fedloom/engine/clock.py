"""The virtual clock's pure parts: how long a client's local work takes (``asynchrony.speeds``)
and how much a stale update counts (``asynchrony.staleness``).

Time is virtual: one unit is one local step of a client of speed 1. A client ``c`` has a
median time per step ``m_c`` fixed for the run (its device), drawn once from the stream
(seed, 'speed', client); each dispatch ``key`` (the synchronous round, or the asynchronous
dispatch event) multiplies it by ``exp(jitter * z)`` with ``z ~ N(0, 1)`` from the stream
(seed, 'speed/jitter', key, client). A job of ``S`` steps then takes ``S * m_c * exp(jitter * z)``.

Staleness functions s(d) of FedAsync (Xie et al., 2019, arXiv:1903.03934, section 5.2), d the
number of server steps since the client downloaded the model it trained from:
constant s = 1; polynomial s_a(d) = (d + 1)^-a; hinge s_{a,b}(d) = 1 if d <= b else
1 / (a (d - b) + 1).
"""

from __future__ import annotations

import math

import torch

from fedloom.core.rng import NO_ID, generator
from fedloom.engine.workload import per_client_value
from fedloom.run_config.asynchrony import AsynchronyConfig, SpeedsConfig


def staleness_weight(kind: str, staleness: int, a: float, b: float) -> float:
    """s(d) of FedAsync section 5.2 for d = ``staleness`` >= 0 (1 at d = 0 for every kind)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return float((staleness + 1) ** (-a))
    if kind == "hinge":
        return 1.0 if staleness <= b else 1.0 / (a * (staleness - b) + 1.0)
    raise ValueError(f"unknown staleness function {kind!r}")


def config_staleness(config: AsynchronyConfig, staleness: int) -> float:
    """s(d) with the run's ``asynchrony.staleness``, ``a`` and ``b``."""
    return staleness_weight(config.staleness, staleness, config.a, config.b)


class Speeds:
    """Each client's time per local step under ``asynchrony.speeds`` (module docstring)."""

    def __init__(self, config: SpeedsConfig, seed: int, clients: list[int]) -> None:
        self.config = config
        self.seed = seed
        self.stragglers = self.slow(clients) if config.kind == "stragglers" else set()
        """The slow clients of ``kind: stragglers``."""
        self.median = {c: self._median(c) for c in clients}
        """m_c: client c's median time per local step, fixed for the run."""

    def _median(self, client: int) -> float:
        cfg = self.config
        if cfg.kind == "constant":
            return 1.0
        if cfg.kind == "lognormal":
            gen = generator(self.seed, "speed", NO_ID, client)
            return math.exp(cfg.sigma * float(torch.randn(1, generator=gen, dtype=torch.float64)))
        if cfg.kind == "per_client":
            assert cfg.values is not None
            return per_client_value(cfg.values, client, "asynchrony.speeds.values", "trains")
        # stragglers: a seeded floor(fraction * n) of the clients are ``slowdown`` times slower
        return cfg.slowdown if client in self.stragglers else 1.0

    def slow(self, clients: list[int]) -> set[int]:
        """The straggling clients of ``kind: stragglers`` (chosen once, from the run's seed)."""
        num = math.floor(self.config.fraction * len(clients))
        order = torch.randperm(len(clients), generator=generator(self.seed, "speed/stragglers"))
        return {clients[i] for i in order[:num].tolist()}

    def step_time(self, client: int, key: int) -> float:
        """Time per local step of ``client``'s job ``key`` (round or dispatch event)."""
        base = self.median[client]
        jitter = self.config.jitter
        if jitter == 0:
            return base
        gen = generator(self.seed, "speed/jitter", key, client)
        return base * math.exp(jitter * float(torch.randn(1, generator=gen, dtype=torch.float64)))

    def duration(self, client: int, key: int, steps: int) -> float:
        """Virtual time of ``steps`` local steps of ``client`` in job ``key``."""
        return steps * self.step_time(client, key)
