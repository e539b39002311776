"""The sequential backend: a client program run for one client at a time, in this process."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedloom.core.rng import generator
from fedloom.solvers.ops import AUTOGRAD
from fedloom.solvers.program import Batch, Carry, ClientProgram, ClientRun, Plan

if TYPE_CHECKING:
    from fedloom.core.protocol import ClientResult, ClientTask, Message, State

MetricSums = dict[str, dict[str, float]]


def run_client(
    program: ClientProgram, message: Message, state: State | None, task: ClientTask
) -> ClientResult:
    """One client's round: ``program.run_lean`` where the program has a fused trainer, else
    init, every update of every step, finish."""
    with program.model.random_stream(program.seed, task.round, task.client_id):
        fused = program.run_lean(message, state, task)
        if fused is not None:
            return fused.stamped(task)
        plans = program.plans(message, state, task)
        carry = program.init(message, state, task)
        run = run_steps(program, carry, plans, program.shared(message, task), task, 0)
    return program.finish(message, state, task, run).stamped(task)


def run_steps(
    program: ClientProgram,
    carry: Carry,
    plans: dict[str, Plan],
    shared: dict,
    task: ClientTask,
    first: int,
    sums: MetricSums | None = None,
    counts: dict[str, int] | None = None,
    streams: dict[str, torch.Generator] | None = None,
) -> ClientRun:
    """Steps ``first`` .. the end of the client's plans, from ``carry``; ``sums``, ``counts``
    and ``streams`` continue the metric sums, step counts and draw streams of steps already
    taken (the vmap backend hands its last few clients over mid-round)."""
    sums = sums if sums is not None else {u.name: {} for u in program.updates}
    counts = counts if counts is not None else {u.name: 0 for u in program.updates}
    streams = streams if streams is not None else draw_streams(program, task)
    end = max((p.end for p in plans.values()), default=0)
    x, y = task.data.x_train, task.data.y_train
    ones: dict[int, torch.Tensor] = {}
    augments = program.augmentations(plans, task)
    with torch.no_grad():
        for s in range(first, end):
            for update in program.updates:
                lead = plans[update.plans[0]]
                if not lead.start <= s < lead.end:
                    continue
                batches = []
                for name in update.plans:
                    plan = plans[name]
                    idx = plan.batches[s - plan.start]
                    n = idx.shape[0]
                    if n not in ones:
                        ones[n] = torch.ones(n)
                    xb = x[idx] if plan.inputs is None else plan.inputs[idx]
                    if name in augments:
                        xb = augments[name].step(xb, s - plan.start)
                    batches.append(Batch(xb, y[idx], ones[n]))
                if update.draw is not None:
                    lead_batch = batches[0]
                    draws = update.draw(streams[update.name])
                    batches[0] = Batch(lead_batch.x, lead_batch.y, lead_batch.w, draws)
                carry, metrics = update.fn(AUTOGRAD, carry, tuple(batches), shared)
                acc = sums[update.name]
                for key, value in metrics.items():
                    acc[key] = acc.get(key, 0.0) + float(value)
                counts[update.name] += 1
    return ClientRun(carry, finish_metrics(sums, counts), counts)


def draw_streams(program: ClientProgram, task: ClientTask) -> dict[str, torch.Generator]:
    """The client's generator for each update that draws (stream (seed, round, client,
    'draws/<update>'), solvers/program.py)."""
    return {
        u.name: generator(program.seed, u.draw_purpose, task.round, task.client_id)
        for u in program.updates
        if u.draw is not None
    }


def finish_metrics(sums: MetricSums, counts: dict[str, int]) -> dict[str, dict[str, float]]:
    """Mean of each metric over the steps its update ran."""
    return {u: {k: v / max(1, counts[u]) for k, v in m.items()} for u, m in sums.items()}
