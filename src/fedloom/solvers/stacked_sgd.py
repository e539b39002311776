"""SGD steps of C clients at once on a stacked model (core/stacked.py), written in place into
the stacked parameters: the FedAvg family's local step and the fine-tuning of deployed
models, with the same math as the one-client trainers (solvers/local.py,
solvers/objective_sgd.py)::

    g_c   <- grad F_c(w_c; B_c) + extra_c          (extra: local_correction at w_c)
    v_c   <- rho v_c + g_c                          (momentum rho > 0 only)
    w_c   <- w_c - lr v_c   (or w_c - lr g_c; or AdamW's step on g_c, solvers/adamw.py)

A linear layer's weight gradient is never formed: ``StackedGrad.add_to`` writes
-lr G^T H into the weight (or the velocity) with one batched product.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch.func import vmap

from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.core.pytree import Tree
from fedloom.core.stacked import FeaturePenalty
from fedloom.data.augment import Augmentation
from fedloom.solvers.adamw import AdamW, Moments, adamw_stacked_
from fedloom.solvers.program import Batch

StepCallback = Callable[[int, range, Tree], None]
"""(steps done, the chunk's client indices, their stacked parameters)."""

Correction = Callable[[Tree, Any], Tree | None]
"""(one client's params, its state) -> the extra gradient term at params (vmapped here)."""


def stacked_sgd_step(
    model: FunctionalModel,
    params: Tree,
    batch: Batch,
    lr: float,
    extra: Tree | None = None,
    velocity: Tree | None = None,
    momentum: float = 0.0,
    trainable: Collection[str] | None = None,
    adamw: AdamW | None = None,
    moments: Moments | None = None,
    penalty: FeaturePenalty | None = None,
) -> torch.Tensor:
    """One SGD step of every client in ``params`` (stacked, updated in place) on its
    minibatch of ``batch`` (x, y, w stacked (C, B, ...)); returns the C losses before the step.
    ``extra``: an extra gradient term per client (already evaluated at ``params``);
    ``velocity``: heavy-ball buffers, updated in place; ``trainable``: the keys that move;
    ``adamw``: an AdamW step instead, with the stacked ``moments`` (updated in place);
    ``penalty``: a term on a linear layer's input features added to each client's loss."""
    stacked = model.stacked()
    assert stacked is not None, "stacked_sgd_step needs a stackable model"
    keys = set(trainable) if trainable is not None else None
    grads, losses = stacked.value_and_grad(
        params, batch.x, batch.y, batch.w, model.per_sample_loss, keys, model.task, penalty
    )
    with torch.no_grad():
        if adamw is not None:
            assert moments is not None, "an AdamW step needs the chunk's moments"
            full = {k: grads.materialize(k) for k in grads.names()}
            if extra is not None:
                full = {k: g + extra[k] for k, g in full.items()}
            adamw_stacked_(params, full, moments, lr, adamw)
            return losses
        for k in grads.names():
            p = params[k]
            if velocity is not None:
                v = velocity[k]
                v.mul_(momentum)
                grads.add_to(k, v, 1.0)
                if extra is not None:
                    v.add_(extra[k])
                p.sub_(v, alpha=lr)
                continue
            if extra is not None:
                p.sub_(extra[k], alpha=lr)
            grads.add_to(k, p, -lr)
    return losses


def stacked_correction(correction: Correction, params: Tree, state: Any) -> Tree | None:
    """``correction`` of every client at its stacked ``params`` (and stacked ``state``, or
    None), vmapped: corrections are pure per-client functions (the ``correction`` option of
    ``SGDProgram``)."""
    if state is None:
        return vmap(lambda p: correction(p, None))(params)
    return vmap(correction)(params, state)


def finetune_stacked(
    model: FunctionalModel,
    starts: Sequence[tuple[Tree, Tree]],
    datas: Sequence[ClientData],
    plans: Sequence[list[torch.Tensor]],
    lr: float,
    trainable: Collection[str] | None = None,
    chunk: int = 32,
    on_step: StepCallback | None = None,
    augments: Sequence[Augmentation | None] | None = None,
) -> list[tuple[Tree, Tree]]:
    """Each client's model after SGD along its ``plan`` from its ``starts`` entry, on its own
    training data, ``chunk`` clients at a time (the same steps as
    :func:`~fedloom.solvers.objective_sgd.objective_sgd`, one client at a time). A client whose
    plan is shorter than the chunk's longest keeps its parameters after its last step.
    ``on_step(done, part, params)`` is called before the first step (``done`` 0) and after each
    with the chunk's client indices and stacked parameters. ``augments``: each plan's
    train-time augmentation (data/augment.py), or None."""
    out: list[tuple[Tree, Tree]] = []
    augments = augments if augments is not None else [None] * len(plans)
    for lo in range(0, len(starts), chunk):
        part = range(lo, min(lo + chunk, len(starts)))
        params = {k: torch.stack([starts[i][0][k] for i in part]) for k in starts[lo][0]}
        steps = max((len(plans[i]) for i in part), default=0)
        if on_step is not None:
            on_step(0, part, params)
        for s in range(steps):
            live = [i for i in part if s < len(plans[i])]
            batch = _gathered(
                [datas[i] for i in part], [plans[i] for i in part], s, [augments[i] for i in part]
            )
            if len(live) == len(part):
                stacked_sgd_step(model, params, batch, lr, trainable=trainable)
            else:  # a client whose plan has ended keeps its parameters: step the others
                rows = [i - lo for i in live]
                sub = {k: v[rows] for k, v in params.items()}
                part_batch = Batch(batch.x[rows], batch.y[rows], batch.w[rows])
                stacked_sgd_step(model, sub, part_batch, lr, trainable=trainable)
                index = torch.tensor(rows)
                for k, v in params.items():
                    v.index_copy_(0, index, sub[k])
            if on_step is not None:
                on_step(s + 1, part, params)
        out += [
            ({k: v[j].clone() for k, v in params.items()}, starts[i][1]) for j, i in enumerate(part)
        ]
    return out


_NO_ROWS = torch.empty(0, dtype=torch.long)


def _gathered(
    datas: Sequence[ClientData],
    plans: Sequence[list[torch.Tensor]],
    step: int,
    augments: Sequence[Augmentation | None],
) -> Batch:
    """Step ``step``'s minibatches of every client (augmented by ``augments``), padded to the
    widest with weight 0."""
    picked = [p[step] if step < len(p) else _NO_ROWS for p in plans]
    width = max(max((int(b.shape[0]) for b in picked), default=1), 1)
    ref = datas[0]
    x = ref.x_train.new_zeros((len(datas), width, *ref.x_train.shape[1:]))
    y = ref.y_train.new_zeros((len(datas), width, *ref.y_train.shape[1:]))
    w = torch.zeros(len(datas), width)
    for row, (d, idx, aug) in enumerate(zip(datas, picked, augments, strict=True)):
        n = int(idx.shape[0])
        if n:
            x[row, :n] = d.x_train[idx] if aug is None else aug.step(d.x_train[idx], step)
            y[row, :n] = d.y_train[idx]
            w[row, :n] = 1.0
    return Batch(x, y, w)


def stacked_update(
    model: FunctionalModel,
    carry: dict[str, Any],
    batch: Batch,
    lr: float,
    trainable: Collection[str] | None = None,
    adamw: AdamW | None = None,
    moments: Moments | None = None,
    penalty: FeaturePenalty | None = None,
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """A program's stacked update (``Update.stacked``) of one SGD or AdamW step on the
    ``trainable`` keys of ``carry['params']``, in place: (the carry, its losses as the
    ``loss`` metric). FedRep's phases, FedPAC's aligned body (``penalty``) and FedBABU's body
    steps."""
    loss = stacked_sgd_step(
        model,
        carry["params"],
        batch,
        lr,
        trainable=trainable,
        adamw=adamw,
        moments=moments,
        penalty=penalty,
    )
    return carry, {"loss": loss}
