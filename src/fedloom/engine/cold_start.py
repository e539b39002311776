"""The cold-start evaluation: how well each algorithm serves a client that never trained.

docs/cold_start.md: a new client uses theta directly or fine-tunes it for 1-5 steps, and the
adaptation efficiency is the number of fine-tuning steps a new client needs. The
``eval.new_clients`` held-out clients never take part in training. At the end of the run each one is
served the algorithm's way (``Deployment.new_client_model``, algorithms/deployment.py: the
global model, a meta-learned initialization, the shared body with a fresh head, a hypernetwork's
model from a fitted embedding) and then fine-tunes it on its own training data::

    w_0 = new_client_model(server, client)
    w_s = w_{s-1} - lr grad F_k(w_{s-1}; B_s)      s = 1..max(steps), on adaptation_keys only
    report accuracy of w_s on the client's held-out data for s in eval.adaptation_steps

with minibatches B_s from the stream (seed, 'adapt', rounds, client) and lr = ``eval.adapt_lr``,
else the algorithm's (``adaptation_lr``: Per-FedAvg's alpha), else ``train.lr``. The result is
summary.json's ``cold_start``: per step, the mean and quantiles over the new clients.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedloom.algorithms.base import Algorithm
from fedloom.core.protocol import ClientData, ClientTask, State
from fedloom.core.pytree import Tree
from fedloom.engine.evaluation import evaluate_stacked
from fedloom.engine.metrics import EvalCounts, client_quantiles
from fedloom.solvers.objective_sgd import objective_sgd
from fedloom.solvers.stacked_sgd import finetune_stacked


@dataclass(frozen=True)
class Adaptation:
    """One cold-start measurement: held-out ``clients`` adapting from the server state for
    ``steps`` at ``lr`` (plans keyed by ``round``), evaluated in batches of
    ``eval_batch_size``."""

    algorithm: Algorithm
    server: State
    clients: dict[int, ClientData]
    steps: list[int]
    lr: float
    round: int
    eval_batch_size: int


def adaptation_curve(
    algorithm: Algorithm,
    server: State,
    clients: dict[int, ClientData],
    steps: list[int],
    lr: float,
    round: int,
    eval_batch_size: int,
    classification: bool,
    batched: bool = False,
) -> dict[str, Any]:
    """summary.json's ``cold_start`` for the held-out ``clients`` (see the module doc);
    ``batched``: every client's fine-tuning at once on the stacked model, where it can run so
    (core/stacked.py) and has no dropout (one client at a time draws each client's masks from
    its own stream)."""
    setup = Adaptation(algorithm, server, clients, steps, lr, round, eval_batch_size)
    model = algorithm.ctx.model
    stacked = batched and model.stacked() is not None and not model.has_dropout
    per_step = _stacked_counts(setup) if stacked else _counts_one_at_a_time(setup)
    curve: dict[str, Any] = {"clients": len(clients), "lr": lr, "steps": list(steps)}
    quantiles = [client_quantiles(per_step[s], classification) for s in steps]
    for key in quantiles[0]:
        curve[key] = [q[key] for q in quantiles]
    return curve


def _stacked_counts(setup: Adaptation) -> dict[int, list[EvalCounts]]:
    """Each step's counts of every client, all clients fine-tuned together (the same steps as
    :func:`_counts_one_at_a_time`)."""
    algorithm, server, clients, steps = setup.algorithm, setup.server, setup.clients, setup.steps
    lr, round, eval_batch_size = setup.lr, setup.round, setup.eval_batch_size
    model, ctx = algorithm.ctx.model, algorithm.ctx
    datas = list(clients.values())
    tasks = [ClientTask.order(cid, data, lr, round) for cid, data in clients.items()]
    starts = [algorithm.deployment.new_client_model(server, t) for t in tasks]
    plans = [ctx.make_plan(t.data, steps[-1], "adapt", round, t.client_id) for t in tasks]
    augments = [
        ctx.make_plan.augmentation(p, "adapt", round, t.client_id)
        for p, t in zip(plans, tasks, strict=True)
    ]
    seen: dict[int, list[EvalCounts | None]] = {}

    def record(done: int, part: range, params: Tree) -> None:
        if done == 0 or done in steps:
            models = [
                ({k: v[j] for k, v in params.items()}, starts[i][1]) for j, i in enumerate(part)
            ]
            counts = evaluate_stacked(
                model, models, [datas[i] for i in part], eval_batch_size, len(part)
            )
            row = seen.setdefault(done, [None] * len(datas))
            for j, i in enumerate(part):
                row[i] = counts[j]

    finetune_stacked(
        model,
        starts,
        datas,
        plans,
        lr,
        trainable=algorithm.deployment.adaptation_keys(),
        on_step=record,
        augments=augments,
    )
    # a client past the end of its plan (no training data) keeps its last model
    out: dict[int, list[EvalCounts]] = {}
    last = list(seen[0])
    for s in sorted({0, *steps}):
        row = seen.get(s, [None] * len(datas))
        last = [r if r is not None else prev for r, prev in zip(row, last, strict=True)]
        if s in steps:
            out[s] = [c for c in last if c is not None]
    return out


def _counts_one_at_a_time(setup: Adaptation) -> dict[int, list[EvalCounts]]:
    """Each step's counts of every client, one client after another on the lean trainer."""
    algorithm, server, clients, steps = setup.algorithm, setup.server, setup.clients, setup.steps
    lr, round, eval_batch_size = setup.lr, setup.round, setup.eval_batch_size
    model = algorithm.ctx.model
    per_step: dict[int, list[EvalCounts]] = {s: [] for s in steps}
    for cid, data in clients.items():
        task = ClientTask.order(cid, data, lr, round)
        params, buffers = algorithm.deployment.new_client_model(server, task)

        def record(done: int, params: Tree, buffers: Tree, data: ClientData = data) -> None:
            if done in per_step:
                counts = model.evaluate(params, buffers, data.x_test, data.y_test, eval_batch_size)
                per_step[done].append(EvalCounts(*counts))

        record(0, params, buffers)
        plan = algorithm.ctx.make_plan(data, steps[-1], "adapt", round, cid)
        if not plan:  # no training data: the client stays at w_0
            for s in steps[1:] if steps[0] == 0 else steps:
                record(s, params, buffers)
            continue
        with model.random_stream(algorithm.ctx.seed, round, cid):
            objective_sgd(
                model,
                params,
                buffers,
                data.x_train,
                data.y_train,
                plan,
                lr,
                trainable=algorithm.deployment.adaptation_keys(),
                augment=algorithm.ctx.make_plan.augmentation(plan, "adapt", round, cid),
                on_step=lambda done, lean, record=record: (
                    record(done, lean.params(), lean.buffers_copy()) if done in per_step else None
                ),
            )
    return per_step
