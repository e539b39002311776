"""Training a linear head on a frozen body from features computed once.

While the body is frozen (FedRep's head phase, Collins et al., ICML 2021, arXiv:2102.07078,
Algorithm 1: tau_h head steps with psi fixed), every head step's forward through the body
recomputes the same features h(x) of the same samples. When the body's output is a
deterministic function of each sample alone, the head phase can read h(x_i) from a table made
by one forward pass over the client's training set and step on

    F(omega; B) = 1/|B| sum_{i in B} loss(omega(h(x_i)), y_i),

the same objective: the same steps up to float summation order (a forward over the whole set
against one per minibatch). docs/leaderboard_algorithms.md ("FedRep's head phase") has the
speed it buys. The table is only valid when:

- the head is one ``nn.Linear`` (``FedModel.head_modules``) and the model returns its output
  as is (nothing after the head);
- the model has no dropout (each step draws new masks) and no buffers (BatchNorm normalizes
  by the minibatch's statistics in training mode and updates its running ones);
- no augmentation (each step transforms the inputs anew).

:func:`frozen_body_head` checks these; the backends read the table through ``Plan.inputs``
(solvers/program.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from fedloom.core.functional import FunctionalModel
from fedloom.core.pytree import Tree
from fedloom.solvers.adamw import AdamW, Moments, adamw_stacked_
from fedloom.solvers.program import Batch, weighted_mean

FEATURE_CHUNK = 1024
"""Samples per forward pass when the table is made (bounded memory for large clients)."""


def frozen_body_head(
    model: FunctionalModel, head_keys: list[str], params: Tree, buffers: Tree, x: torch.Tensor
) -> str | None:
    """The name of the model's linear head when a head phase may train on a feature table
    (the conditions of the module doc, except augmentation, which the caller checks), else
    None. ``head_keys`` are the phase's trainable keys: they must be the head's parameters.
    ``x`` is one sample or more, for one forward pass that checks nothing follows the head."""
    module = model.module
    heads = tuple(getattr(module, "head_modules", ()))
    if len(heads) != 1 or model.has_dropout or model.buffer_keys:
        return None
    linear = module.get_submodule(heads[0])
    if not isinstance(linear, nn.Linear):
        return None
    own = sorted(f"{heads[0]}.{name}" for name, _ in linear.named_parameters())
    if sorted(head_keys) != own:
        return None
    return heads[0] if _output_is_heads(model, params, buffers, x, linear) else None


def _output_is_heads(
    model: FunctionalModel, params: Tree, buffers: Tree, x: torch.Tensor, head: nn.Module
) -> bool:
    """Whether the model's output on ``x`` is the very tensor its head returned."""
    seen: dict[str, torch.Tensor] = {}

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> None:
        seen["out"] = out

    handle = head.register_forward_hook(hook)
    try:
        with torch.no_grad():
            out = model.forward(params, buffers, x)
    finally:
        handle.remove()
    return out is seen.get("out")


@torch.no_grad()
def body_features(
    model: FunctionalModel, head: str, params: Tree, buffers: Tree, x: torch.Tensor
) -> torch.Tensor:
    """h(x): the head's input for every row of ``x``, in chunks of ``FEATURE_CHUNK``."""
    parts = [
        model.forward_with_features(params, buffers, x[lo : lo + FEATURE_CHUNK], head)[1]
        for lo in range(0, int(x.shape[0]), FEATURE_CHUNK)
    ]
    if parts:
        return torch.cat(parts)
    dim = model.module.get_submodule(head).in_features
    return torch.zeros((0, dim), dtype=next(iter(params.values())).dtype)


def head_loss(model: FunctionalModel, head: str, params: Tree, batch: Batch) -> torch.Tensor:
    """The mean loss over the real samples of ``batch``, whose inputs are features h(x), of
    the linear head ``head`` in ``params``. Pure, for ``vmap``."""
    out = F.linear(batch.x, params[f"{head}.weight"], params.get(f"{head}.bias"))
    return weighted_mean(model.per_sample_loss(out, batch.y), batch.w)


def stacked_head_step(
    model: FunctionalModel,
    head: str,
    params: Tree,
    batch: Batch,
    lr: float,
    adamw: AdamW | None = None,
    moments: Moments | None = None,
) -> torch.Tensor:
    """One SGD step (or AdamW's, with the stacked ``moments``) of C clients' linear heads at
    once, in place on the stacked ``params``, on their minibatches of features (x (C, B, d));
    the C losses before the step. :func:`head_loss`'s gradient for every client, without
    ``vmap``: one batched product forward and autograd through it."""
    keys = [k for k in (f"{head}.weight", f"{head}.bias") if k in params]
    leaves = {k: params[k].detach().requires_grad_(True) for k in keys}
    clients, width = batch.x.shape[0], batch.x.shape[1]
    with torch.enable_grad():
        out = torch.bmm(batch.x, leaves[f"{head}.weight"].transpose(1, 2))
        if f"{head}.bias" in leaves:
            out = out + leaves[f"{head}.bias"].unsqueeze(1)
        targets = batch.y.reshape(clients * width, *batch.y.shape[2:])
        per = model.per_sample_loss(out.reshape(clients * width, -1), targets)
        losses = (per.view(clients, width) * batch.w).sum(1) / batch.w.sum(1).clamp_min(1.0)
        grads = dict(
            zip(keys, torch.autograd.grad(losses.sum(), list(leaves.values())), strict=True)
        )
    with torch.no_grad():
        if adamw is not None:
            assert moments is not None, "an AdamW step needs the chunk's moments"
            adamw_stacked_(params, grads, moments, lr, adamw)
        else:
            for k, g in grads.items():
                params[k].sub_(g, alpha=lr)
    return losses.detach()
