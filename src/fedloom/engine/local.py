"""The local solver every client-side algorithm shares: minibatch SGD over a batch plan.

The plan (which samples each step uses) comes from the stream (seed, round, client, 'batches'):
each epoch is one permutation of the client's samples sliced into contiguous batches, so the
same plan is reproduced on every executor.
"""

from __future__ import annotations

import math

import torch

from fedloom.engine.functional import FunctionalModel, GradCorrection
from fedloom.engine.pytree import Tree


def num_local_steps(n: int, batch_size: int | None, epochs: int | None, steps: int | None) -> int:
    """Steps one client runs: ``steps`` if given, else ``epochs * ceil(n / batch_size)``."""
    if steps is not None:
        return steps
    per_epoch = 1 if batch_size is None else max(1, math.ceil(n / batch_size))
    return int(epochs or 1) * per_epoch


def batch_plan(
    n: int, batch_size: int | None, num_steps: int, gen: torch.Generator
) -> list[torch.Tensor]:
    """Index tensors for ``num_steps`` minibatches: epochs of permutations cut into batches.

    ``batch_size`` None (or >= n) means full batch: every step uses all ``n`` samples in order.
    """
    if n == 0:
        return []
    if batch_size is None or batch_size >= n:
        full = torch.arange(n)
        return [full] * num_steps
    plan: list[torch.Tensor] = []
    while len(plan) < num_steps:
        perm = torch.randperm(n, generator=gen)
        plan.extend(perm[i : i + batch_size] for i in range(0, n, batch_size))
    return plan[:num_steps]


def local_sgd(
    model: FunctionalModel,
    params: Tree,
    buffers: Tree,
    x: torch.Tensor,
    y: torch.Tensor,
    plan: list[torch.Tensor],
    lr: float,
    correction: GradCorrection | None = None,
) -> tuple[Tree, Tree, float]:
    """Run SGD steps w <- w - lr (grad F_k(w; batch) + correction(w)) along ``plan``.

    Returns the new params, the (updated) buffers and the mean minibatch loss. The inputs are
    not modified; buffers are copied before BatchNorm updates them.
    """
    params = {k: v.detach() for k, v in params.items()}
    buffers = {k: v.clone() for k, v in buffers.items()}
    total = torch.zeros(())
    with torch.no_grad():
        for idx in plan:
            grads, loss = model.grad_and_loss(params, buffers, x[idx], y[idx])
            if correction is not None:
                extra = correction(params)
                grads = {k: g + extra[k] for k, g in grads.items()}
            params = {k: p - lr * grads[k] for k, p in params.items()}
            total += loss
    return params, buffers, float(total) / max(1, len(plan))
