"""Recalibrating normalization layers' running statistics on a client's own data.

A model whose BatchNorm statistics were never computed on a client's inputs (FedBN's held-out
new client, Li et al., ICLR 2021, arXiv:2102.07623: a new client's BN statistics must be
calibrated before it deploys) gets them from forward passes over
that client's training data in training mode, without gradients and without changing any
weight. The statistics are a cumulative average over the passes, like BatchNorm with
``momentum=None``, except that each batch weighs by its number of samples (identical when the
batches are equal): the running mean of a layer whose input does not depend on the batch
composition (the first one) is then exactly the mean of its inputs over the data.
"""

from __future__ import annotations

from collections.abc import Collection

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.modules.batchnorm import _NormBase

from fedloom.core.pytree import Tree, clone


def running_stat_layers(
    module: nn.Module, names: Collection[str] | None = None
) -> dict[str, _NormBase]:
    """The normalization layers of ``module`` that track running statistics (BatchNorm and
    InstanceNorm with ``track_running_stats``), by name; ``names`` restricts them."""
    return {
        name: m
        for name, m in module.named_modules()
        if isinstance(m, _NormBase) and m.track_running_stats and (names is None or name in names)
    }


@torch.no_grad()
def calibrate_norm_stats(
    module: nn.Module,
    params: Tree,
    buffers: Tree,
    x: torch.Tensor,
    batch_size: int | None = None,
    layers: Collection[str] | None = None,
) -> Tree:
    """The buffers of ``module`` at (``params``, ``buffers``) with the running statistics of
    its normalization layers (``layers``: names of submodules; None: all that track them)
    recomputed on the inputs ``x``.

    ``x`` is passed in order (no shuffling) in batches of ``batch_size`` (None: one batch);
    each selected layer runs in training mode, so it normalizes with the batch's statistics
    and accumulates them, while every other module is in evaluation mode (no dropout: the
    result is deterministic). ``num_batches_tracked`` ends equal to the number of batches.
    Pure: ``params`` and ``buffers`` are not modified (the buffers are copied, the module's
    modes and momenta are restored). Without samples or layers the copy is returned as is.
    """
    out = clone(buffers)
    selected = running_stat_layers(module, layers)
    n = int(x.shape[0])
    if not selected or n == 0:
        return out
    for name in selected:
        out[f"{name}.running_mean"].zero_()
        out[f"{name}.running_var"].fill_(1.0)
        out[f"{name}.num_batches_tracked"].zero_()
    modes = {m: m.training for m in module.modules()}
    momenta = {m: m.momentum for m in selected.values()}
    size = n if batch_size is None else max(1, min(batch_size, n))
    try:
        module.eval()
        for m in selected.values():
            m.train()
        seen = 0
        for start in range(0, n, size):
            xb = x[start : start + size]
            seen += int(xb.shape[0])
            for m in selected.values():
                m.momentum = int(xb.shape[0]) / seen  # cumulative, sample-weighted average
            functional_call(module, (params, out), (xb,))  # updates ``out`` in place
    finally:
        for m, momentum in momenta.items():
            m.momentum = momentum
        for m, training in modes.items():
            m.training = training
    return out
