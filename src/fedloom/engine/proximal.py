"""The proximal term mu/2 ||w - anchor||^2 shared by FedProx, Ditto, pFedMe and FedDyn."""

from __future__ import annotations

from fedloom.engine.functional import GradCorrection
from fedloom.engine.pytree import Tree


def proximal_gradient(anchor: Tree, mu: float) -> GradCorrection | None:
    """The gradient mu (w - anchor) of mu/2 ||w - anchor||^2; None when mu is 0."""
    if mu == 0:
        return None
    return lambda params: {k: mu * (params[k] - anchor[k]) for k in params}
