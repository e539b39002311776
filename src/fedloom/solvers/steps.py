"""Pieces client programs are made of: gradients of the model's loss on a minibatch and SGD
steps on all or some of the parameters, with an optional proximal pull. Pure functions of
tensors, so one definition serves both backends (solvers/ops.py)."""

from __future__ import annotations

from collections.abc import Collection

import torch

from fedloom.core.functional import FunctionalModel
from fedloom.solvers.program import Batch, Ops

Tree = dict[str, torch.Tensor]


def loss_grad(
    ops: Ops, model: FunctionalModel, params: Tree, buffers: Tree, batch: Batch
) -> tuple[Tree, torch.Tensor]:
    """Gradient of the model's mean loss on the batch's real samples, and the loss
    (``ops.loss_grad``): under sample-level DP, DP-SGD's private gradient (docs/privacy.md).
    In training mode the forward pass updates ``buffers`` (BatchNorm statistics) in place."""
    return ops.loss_grad(model, params, buffers, batch)


def subset_loss_grad(
    ops: Ops,
    model: FunctionalModel,
    params: Tree,
    keys: Collection[str],
    buffers: Tree,
    batch: Batch,
) -> tuple[Tree, torch.Tensor]:
    """Gradient with respect to ``params[keys]`` only (the rest held fixed), and the loss.
    Through ``ops.value_and_grad``: it has no private version, so under sample-level DP it
    raises (solvers/ops.py, PrivateOps)."""
    fixed = {k: v for k, v in params.items() if k not in keys}

    def loss(trainable: Tree) -> torch.Tensor:
        return model.weighted_loss({**fixed, **trainable}, buffers, batch.x, batch.y, batch.w)

    return ops.value_and_grad(loss, {k: params[k] for k in keys})


def descend(
    params: Tree,
    grads: Tree,
    lr: float | torch.Tensor,
    anchor: Tree | None = None,
    mu: float = 0.0,
) -> Tree:
    """params - lr * grads on the keys of ``grads`` (the others unchanged); one fused kernel
    per tensor for a number ``lr`` (a memory-bound pass: W3's 31 MB per step). With a proximal
    pull (``anchor``, mu > 0), params - lr (grads + mu (params - anchor)) as
    ((1 - lr mu) params + lr mu anchor) - lr grads: the kernels the vmap backend can also run
    in place (Ditto (9), pFedMe (6))."""
    if anchor is not None and mu:
        w = lr * mu
        return {
            k: _step(torch.add(p * (1.0 - w), anchor[k], alpha=w), grads[k], lr)
            if k in grads
            else p
            for k, p in params.items()
        }
    return {k: _step(p, grads[k], lr) if k in grads else p for k, p in params.items()}


def _step(p: torch.Tensor, g: torch.Tensor, lr: float | torch.Tensor) -> torch.Tensor:
    return p - lr * g if isinstance(lr, torch.Tensor) else torch.add(p, g, alpha=-lr)


def proximal_gradient(params: Tree, anchor: Tree, mu: float) -> Tree | None:
    """The gradient mu (w - anchor) of the proximal term mu/2 ||w - anchor||^2 at ``params``
    (FedProx, FedNova, FedDyn, Ditto (9), pFedMe (6)); None when mu is 0."""
    if mu == 0:
        return None
    return {k: mu * (params[k] - anchor[k]) for k in params}


def prox_sgd_step(
    ops: Ops,
    model: FunctionalModel,
    params: Tree,
    buffers: Tree,
    batch: Batch,
    lr: float,
    anchor: Tree,
    mu: float,
) -> tuple[Tree, torch.Tensor]:
    """One step w <- w - lr (grad f(w; batch) + mu (w - anchor)); returns (w, f(w; batch))."""
    grads, loss = loss_grad(ops, model, params, buffers, batch)
    return ops.descend(params, grads, lr, anchor, mu), loss
