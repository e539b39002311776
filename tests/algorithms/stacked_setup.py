"""A program's stacked update (core/stacked.py) against the same update vmapped, step by step,
from the same carries and minibatches: the check behind the Ditto, FedPAC and APPLE tests of
their stacked steps."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.func import vmap

from fedloom.solvers.ops import FUNC
from fedloom.solvers.program import Batch
from fedloom.solvers.vmap import stack_carries


def step_both(
    carries: list[dict],
    batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    stacked_step: Callable[..., tuple[dict, dict]],
    step: Callable[..., tuple[dict, dict]],
    shared: dict[str, Any],
    steps: int = 4,
    loss_atol: float | None = 1e-6,
) -> tuple[dict, dict]:
    """The chunk's stacked carry after ``steps`` calls of ``stacked_step`` and after as many of
    ``step`` vmapped over the clients, on the stacked minibatch ``batch`` (x, y, w); each
    step's losses agree to ``loss_atol`` (None: not compared)."""
    leaves, spec = stack_carries(carries, torch.device("cpu"))
    stacked, vmapped = spec.build([v.clone() for v in leaves]), spec.build(leaves)
    x, y, w = batch

    def one(carry: dict, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> Any:
        return step(FUNC, carry, (Batch(x, y, w),), shared)

    for _ in range(steps):
        stacked, got = stacked_step(stacked, (Batch(x, y, w),), shared)
        vmapped, want = vmap(one)(vmapped, x, y, w)
        if loss_atol is not None:
            assert torch.allclose(got["loss"], want["loss"], atol=loss_atol)
    return stacked, vmapped
