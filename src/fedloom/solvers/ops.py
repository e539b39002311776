"""Gradients and steps for client programs: reverse-mode autograd one client at a time, or
torch.func under vmap. An update asks ``ops.value_and_grad(f, params, ...)`` and
``ops.descend(params, grads, lr)`` and never knows which."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.func import grad_and_value

from fedloom.solvers.steps import descend

Tree = dict[str, torch.Tensor]


class Steps:
    """The SGD step both kinds of ops share: ``steps.descend`` out of place; with ``in_place``
    (only the vmap backend's choice, see FuncOps) written into ``params``. One client's carry
    may share tensors with the round's message (FedAvg starts from the global model), so the
    sequential ops never write in place."""

    in_place = False

    def descend(
        self,
        params: Tree,
        grads: Tree,
        lr: float | torch.Tensor,
        anchor: Tree | None = None,
        mu: float = 0.0,
    ) -> Tree:
        """params - lr (grads + mu (params - anchor)), see ``steps.descend``."""
        if not self.in_place:
            return descend(params, grads, lr, anchor, mu)
        for k, g in grads.items():
            p = params[k]
            if anchor is not None and mu:  # as steps.descend; lerp_ has no vmap batching rule
                p.mul_(1.0 - lr * mu).add_(anchor[k], alpha=lr * mu)
            if isinstance(lr, torch.Tensor):
                p.sub_(lr * g)
            else:
                p.add_(g, alpha=-lr)
        return params


class AutogradOps(Steps):
    """One client: ``torch.autograd.grad`` on fresh leaves. Cheaper per call than torch.func
    for small models (benchmarks/README.md, Design measurements). Inside an outer
    differentiation (inputs already require grad, as in
    Per-FedAvg's second-order variants) the graph is kept so the outer call can go through."""

    def value_and_grad(
        self, f: Callable[..., torch.Tensor], params: Tree, *args: Any
    ) -> tuple[Tree, torch.Tensor]:
        nested = torch.is_grad_enabled() and any(v.requires_grad for v in params.values())
        leaves = (
            params if nested else {k: v.detach().requires_grad_(True) for k, v in params.items()}
        )
        with torch.enable_grad():
            value = f(leaves, *args)
            grads = torch.autograd.grad(value, list(leaves.values()), create_graph=nested)
        if not nested:
            value = value.detach()
        return dict(zip(leaves, grads, strict=True)), value

    def value_and_grad_aux(
        self, f: Callable[..., tuple[torch.Tensor, Any]], params: Tree, *args: Any
    ) -> tuple[Tree, torch.Tensor, Any]:
        """As ``value_and_grad`` for ``f`` returning (scalar, aux): (grads, scalar, aux), aux
        out of the graph."""
        held: list[Any] = []

        def value(p: Tree, *a: Any) -> torch.Tensor:
            v, aux = f(p, *a)
            held.append(aux)
            return v

        grads, v = self.value_and_grad(value, params, *args)
        return grads, v, _detached(held[0])


class FuncOps(Steps):
    """Many clients under ``vmap``: ``torch.func.grad_and_value`` (composable with vmap and
    with itself). With ``in_place`` (the vmap backend's choice when it owns the stacked carry
    and every client of the call takes the step, so nothing has to be masked), ``descend``
    writes into ``params``: W3's 31 MB update without a fresh block each step
    (benchmarks/README.md, Design measurements)."""

    def __init__(self, in_place: bool = False) -> None:
        self.in_place = in_place

    def value_and_grad(
        self, f: Callable[..., torch.Tensor], params: Tree, *args: Any
    ) -> tuple[Tree, torch.Tensor]:
        return grad_and_value(f)(params, *args)

    def value_and_grad_aux(
        self, f: Callable[..., tuple[torch.Tensor, Any]], params: Tree, *args: Any
    ) -> tuple[Tree, torch.Tensor, Any]:
        grads, (value, aux) = grad_and_value(f, has_aux=True)(params, *args)
        return grads, value, aux


def _detached(obj: Any) -> Any:
    """``obj`` with every tensor in its dicts, lists and tuples detached."""
    if isinstance(obj, torch.Tensor):
        return obj.detach()
    if isinstance(obj, dict):
        return {k: _detached(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_detached(v) for v in obj)
    return obj


AUTOGRAD = AutogradOps()
FUNC = FuncOps()
FUNC_IN_PLACE = FuncOps(in_place=True)
