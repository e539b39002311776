"""``train.optimizer`` in client programs with steps of their own (APFL, pFedMe, Per-FedAvg,
pFedMac, FedCR's stochastic program; docs/optimizers.md, "Which algorithms").

Such a program names each model it moves with the local optimizer (APFL: ``theta`` and
``omega``; pFedMe: ``theta``; ...): the step on that model's gradient is the program's own SGD
step, or, with ``train.optimizer: adamw``, AdamW's (Loshchilov and Hutter, ICLR 2019,
Algorithm 2; solvers/adamw.py) with moments of that model's own in the carry under
``adamw/<name>``. The moments start from zero every round (``moments: round``) or, with
``moments: client``, continue from the ones the client's state keeps under
``adamw`` -> ``<name>`` (checkpointed with the rest of the client state)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedloom.core.protocol import State
from fedloom.core.pytree import Tree
from fedloom.solvers.adamw import MOMENTS, AdamW, adamw_step, init_moments
from fedloom.solvers.program import Carry
from fedloom.solvers.steps import descend, proximal_gradient

SGDStep = Callable[[Tree, Tree, float | torch.Tensor, Tree | None, float], Tree]
"""(params, grads, lr, anchor, mu) -> params - lr (grads + mu (params - anchor)): a program's
SGD step (``ops.descend`` or the pure ``steps.descend``)."""


def slot(name: str) -> str:
    """The carry's key of the moments of the model ``name``."""
    return f"{MOMENTS}/{name}"


class LocalOptimizer:
    """The local optimizer of a program with steps of its own: SGD (``adamw`` None) or AdamW,
    each named model's moments in the carry."""

    def __init__(self, adamw: AdamW | None) -> None:
        self.adamw = adamw

    @property
    def persists(self) -> bool:
        """Whether the moments are kept in the client's state (``moments: client``)."""
        return self.adamw is not None and self.adamw.persist

    def start(self, carry: Carry, state: State | None, models: dict[str, Tree]) -> Carry:
        """``carry`` with AdamW's moments of each named model (none under SGD): the client's
        kept ones (``moments: client``, once it has trained), else zero."""
        if self.adamw is None:
            return carry
        kept_all = state.get(MOMENTS, {}) if self.persists and state is not None else {}
        for name, params in models.items():
            kept = kept_all.get(name)
            carry[slot(name)] = kept if kept is not None else init_moments(params)
        return carry

    def step(
        self,
        carry: Carry,
        name: str,
        params: Tree,
        grads: Tree,
        lr: float | torch.Tensor,
        sgd: SGDStep = descend,
        anchor: Tree | None = None,
        mu: float = 0.0,
    ) -> Tree:
        """The model ``name`` after one step on ``grads`` plus, with ``anchor``, the proximal
        pull mu (w - anchor) (pFedMe's inner problem): ``sgd``'s (its fused proximal kernels),
        or AdamW's on the moments ``carry`` holds for it (``carry`` gets the new moments: hand
        it a copy)."""
        if self.adamw is None:
            return sgd(params, grads, lr, anchor, mu)
        pull = proximal_gradient(params, anchor, mu) if anchor is not None else None
        if pull is not None:
            grads = {k: g + pull[k] for k, g in grads.items()}
        params, carry[slot(name)] = adamw_step(params, grads, carry[slot(name)], lr, self.adamw)
        return params

    def kept(self, carry: Carry, names: tuple[str, ...]) -> State:
        """What the client's new state keeps of the moments (``moments: client``): each named
        model's, under ``adamw`` -> ``<name>``; nothing otherwise."""
        if not self.persists:
            return {}
        return {MOMENTS: {name: carry[slot(name)] for name in names}}
