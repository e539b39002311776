"""The backdoor's success rate (Bagdasaryan et al. 2020, section 5): the fraction of triggered
test inputs whose true class is not the target that a model classifies as the target."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fedloom.attacks.data import apply_trigger
from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData

Tree = dict[str, torch.Tensor]


@torch.no_grad()
def backdoor_success(
    model: FunctionalModel,
    params: Tree,
    buffers: Tree,
    clients: Sequence[ClientData],
    target: int,
    size: int,
    value: float,
    batch_size: int = 1024,
) -> float | None:
    """Over the clients' test sets (None when no test sample is outside the target class)."""
    hits, total = 0, 0
    model.module.eval()
    try:
        for client in clients:
            keep = client.y_test != target
            x = client.x_test[keep]
            for start in range(0, x.shape[0], batch_size):
                stamped = apply_trigger(x[start : start + batch_size], size, value)
                out = model.forward(params, buffers, stamped)
                hits += int((out.argmax(-1) == target).sum())
                total += int(stamped.shape[0])
    finally:
        model.module.train()
    return hits / total if total else None
