"""How much local work each sampled client does in a round (system heterogeneity).

A client's budget is ``train.local_steps`` steps, or ``train.local_epochs`` passes over its data
cut into ``train.batch_size`` minibatches; either may be a fixed number or a
:class:`~fedloom.run_config.train.WorkDistribution` drawn per client (and per round). On top of
that a fraction ``train.stragglers`` of each round's clients straggle, as in the FedProx paper
(Li et al., MLSys 2020, section 5.2): with ``straggler_mode: partial`` a straggler completes a
uniform draw from 1..S of its S steps; with ``drop`` it completes nothing and the server
drops it (0 steps). Every draw comes from a seeded stream, so all executors and resumed runs
see the same budgets.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from fedloom.core.protocol import ClientData, ClientTask
from fedloom.core.rng import NO_ID, generator
from fedloom.errors import ConfigError
from fedloom.run_config.train import TrainConfig, WorkDistribution
from fedloom.solvers.local import PlanMaker, steps_per_epoch


def per_client_value(values: list[Any], client: int, key: str, role: str) -> Any:
    """``values[client]``, or a ConfigError naming ``key`` when the list does not reach
    ``client`` (``role``: what the client does that needs the value)."""
    if not 0 <= client < len(values):
        raise ConfigError(
            f"{key} has {len(values)} entries, but client {client} {role} (one value per "
            "client is needed)"
        )
    return values[client]


def draw_work(spec: int | WorkDistribution, seed: int, round: int, client: int) -> int:
    """The number of epochs or steps ``client`` does in ``round`` under ``spec``."""
    if isinstance(spec, int):
        return spec
    if spec.kind == "per_client":
        assert spec.values is not None
        return per_client_value(
            spec.values, client, "train local work: per_client values", "takes part"
        )
    gen = generator(seed, "work", round if spec.per == "round" else NO_ID, client)
    if spec.kind == "uniform":
        assert spec.low is not None and spec.high is not None
        return int(torch.randint(spec.low, spec.high + 1, (1,), generator=gen))
    assert spec.values is not None
    probs = torch.tensor(spec.probs or [1.0] * len(spec.values), dtype=torch.float64)
    return spec.values[int(torch.multinomial(probs, 1, generator=gen))]


def full_budget(train: TrainConfig, seed: int, round: int, client: int, n: int) -> int:
    """Local steps ``client`` (holding ``n`` training samples) is asked to do in ``round``."""
    if train.local_steps is not None:
        return draw_work(train.local_steps, seed, round, client)
    epochs = draw_work(train.local_epochs or 1, seed, round, client)
    return epochs * steps_per_epoch(n, train.batch_size)


def most_work(spec: int | WorkDistribution, client: int) -> int:
    """The largest number of epochs or steps ``spec`` can give ``client`` in a round."""
    if isinstance(spec, int):
        return spec
    if spec.kind == "uniform":
        assert spec.high is not None
        return spec.high
    assert spec.values is not None
    if spec.kind == "per_client" and 0 <= client < len(spec.values):
        return spec.values[client]
    return max(spec.values)


def most_steps(train: TrainConfig, client: int, n: int) -> int:
    """An upper bound on the local steps ``client`` (holding ``n`` samples) takes in a round
    (stragglers only take fewer): what sample-level DP calibrates its noise for."""
    if train.local_steps is not None:
        return most_work(train.local_steps, client)
    return most_work(train.local_epochs or 1, client) * steps_per_epoch(n, train.batch_size)


def straggler_steps(
    seed: int,
    round: int,
    clients: list[int],
    full_steps: list[int],
    fraction: float,
    mode: str = "partial",
) -> list[int]:
    """Steps each client completes: floor(fraction * len(clients)) of them, chosen at random,
    straggle and complete a uniform draw from 1..S of their S steps (``partial``) or none
    (``drop``: the server will not hear from them this round)."""
    if fraction <= 0 or not clients:
        return list(full_steps)
    gen = generator(seed, "stragglers", round)
    num = math.floor(fraction * len(clients))
    chosen = set(torch.randperm(len(clients), generator=gen)[:num].tolist())
    steps = list(full_steps)
    for i in sorted(chosen):
        partial = int(torch.randint(1, max(1, full_steps[i]) + 1, (1,), generator=gen))
        steps[i] = partial if mode == "partial" else 0
    return steps


def client_tasks(
    train: TrainConfig,
    seed: int,
    datas: dict[int, ClientData],
    make_plan: PlanMaker,
    round: int,
    clients: list[int],
) -> list[ClientTask]:
    """Work orders of the clients that report back in ``round`` (dropped stragglers, with
    ``train.straggler_mode: drop``, get none): each client's budget, cut by straggling, as a
    plan of minibatches."""
    chosen = [datas[c] for c in clients]
    full = [
        full_budget(train, seed, round, c, d.num_train)
        for c, d in zip(clients, chosen, strict=True)
    ]
    steps = straggler_steps(seed, round, clients, full, train.stragglers, train.straggler_mode)
    return [
        ClientTask.order(c, d, train.lr, round, make_plan, s, full=f)
        for c, d, s, f in zip(clients, chosen, steps, full, strict=True)
        if s > 0
    ]
