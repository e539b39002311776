"""Sample-level DP-SGD inside a client (Abadi et al., CCS 2016, Algorithm 1), with Opacus's
semantics, written with torch.func so one definition runs on both backends (and under the vmap
backend's client ``vmap``):

    g_i    = grad l(w; x_i, y_i)                          per-sample gradients (vmap over i)
    g_i   <- g_i min(1, C / (||g_i|| + 1e-6))             ||.|| over all parameters together
    g      = (sum_i m_i g_i + sigma C xi) / (q n)         xi ~ N(0, I), one draw per parameter

m_i is 1 for a sampled sample and 0 for padding; the minibatch is a Poisson sample (each of the
client's n samples independently with probability q, solvers/local.py ``poisson_plan``), and the
divisor is the expected batch size q n, as Opacus's ``loss_reduction="mean"``. The noise xi is
drawn outside ``vmap`` from the client's own stream (``Update.draw``, in parameter order), so
every backend adds the same noise. The privacy accounting of the resulting steps is the
privacy layer's (privacy/sample_dp.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.func import grad_and_value, vmap

from fedloom.core.functional import FunctionalModel
from fedloom.solvers.program import Batch, Draw

Tree = dict[str, torch.Tensor]

NORM_EPS = 1e-6
"""Opacus's clipping factor (C / (norm + 1e-6)).clamp(max=1)."""


@dataclass(frozen=True)
class DPSGD:
    """DP-SGD's settings inside each client: the per-sample bound C, the noise multiplier
    sigma and the minibatch size B (``train.batch_size``; None: full batch)."""

    clip: float
    noise_multiplier: float
    batch_size: int | None

    def expected_batch(self, n: int) -> float:
        """q n = min(B, n): the expected Poisson minibatch size of a client of n samples, the
        divisor of its noised gradient sum."""
        return float(n if self.batch_size is None else max(1, min(self.batch_size, n)))

    def noise_draw(self, shapes: Sequence[tuple[str, torch.Size]]) -> Draw:
        """The step's standard normal draws, one tensor per parameter in model order (what
        ``private_grad`` scales by sigma C)."""
        frozen = tuple(shapes)

        def draw(gen: torch.Generator) -> Tree:
            return {k: torch.randn(shape, generator=gen) for k, shape in frozen}

        return draw

    def step_bytes(self, param_bytes: int, width: int) -> int:
        """Per-sample gradients and their clipped copies of one client's step."""
        return 2 * param_bytes * max(1, width)


def private_grad(
    model: FunctionalModel,
    params: Tree,
    buffers: Tree,
    batch: Batch,
    dp: DPSGD,
    expected_batch: float | torch.Tensor,
) -> tuple[Tree, torch.Tensor]:
    """The noised mean of the clipped per-sample gradients of the model's loss on ``batch``
    (module docstring), and the mean loss over its real samples. ``batch.draws`` holds the
    step's standard normal noise (None: no noise, as sigma = 0); ``expected_batch`` is the
    client's q n (``DPSGD.expected_batch``; a tensor under vmap, one per client)."""
    if batch.x.shape[0] == 0:  # a Poisson step that sampled nothing: noise alone
        grads = {k: torch.zeros_like(v) for k, v in params.items()}
        loss = params[next(iter(params))].new_zeros(())
    else:

        def sample_loss(p: Tree, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            out = model.forward(p, buffers, x.unsqueeze(0))
            return model.per_sample_loss(out, y.unsqueeze(0))[0]

        per_sample, losses = vmap(grad_and_value(sample_loss), in_dims=(None, 0, 0))(
            params, batch.x, batch.y
        )
        # one fused reduction per tensor, then one weighted sum: the (batch x parameters)
        # per-sample gradients are read twice, never copied
        sq = sum(
            torch.linalg.vector_norm(g.reshape(g.shape[0], -1), dim=1).square()
            for g in per_sample.values()
        )
        factor = (dp.clip / (sq.sqrt() + NORM_EPS)).clamp(max=1.0) * batch.w / expected_batch
        grads = {k: torch.tensordot(factor, g, dims=1) for k, g in per_sample.items()}
        loss = (losses * batch.w).sum() / batch.w.sum().clamp_min(1.0)
    std = dp.noise_multiplier * dp.clip
    if batch.draws is not None and std > 0:
        scale = std / expected_batch
        grads = {k: g + batch.draws[k] * scale for k, g in grads.items()}
    return grads, loss
