"""The proximal term mu/2 ||w - anchor||^2 shared by FedProx, Ditto, pFedMe and FedDyn."""

from __future__ import annotations

from fedloom.engine.pytree import Tree


def proximal_gradient(params: Tree, anchor: Tree, mu: float) -> Tree | None:
    """The gradient mu (w - anchor) of mu/2 ||w - anchor||^2 at ``params``; None when mu is 0."""
    if mu == 0:
        return None
    return {k: mu * (params[k] - anchor[k]) for k in params}
