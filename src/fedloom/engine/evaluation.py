"""Evaluation of many clients' deployed models on their own held-out data: one at a time, or
C at a time under ``vmap`` (the personalized evaluation PFL runs do every few rounds)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.func import vmap

from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.core.pytree import Tree
from fedloom.core.stacked import StackedModel
from fedloom.engine.metrics import EvalCounts

Model = tuple[Tree, Tree]


def evaluate_each(
    model: FunctionalModel, models: list[Model], datas: list[ClientData], batch_size: int
) -> list[EvalCounts]:
    return [
        EvalCounts(*model.evaluate(p, b, d.x_test, d.y_test, batch_size))
        for (p, b), d in zip(models, datas, strict=True)
    ]


def evaluate_pooled(
    model: FunctionalModel, params: Tree, buffers: Tree, datas: list[ClientData], batch_size: int
) -> list[EvalCounts]:
    """One model (the global one) on every client's held-out data: the test sets run as one
    pooled sequence of batches of ``batch_size`` samples (not one client at a time: thousands
    of small clients are thousands of forward calls), and the per-sample losses and hits are
    summed back per client. The same counts as :func:`evaluate_each` with one model."""
    sizes = [d.num_test for d in datas]
    if not sum(sizes):
        return [EvalCounts(0.0, 0.0, 0) for _ in datas]
    classification = model.task == "classification"
    x = torch.cat([d.x_test for d in datas])
    y = torch.cat([d.y_test for d in datas])
    owner = torch.repeat_interleave(torch.arange(len(datas)), torch.tensor(sizes))
    loss = torch.zeros(len(datas), dtype=torch.float64)
    correct = torch.zeros(len(datas), dtype=torch.float64)
    model.module.eval()
    try:
        with torch.no_grad():
            for start in range(0, x.shape[0], batch_size):
                rows = slice(start, start + batch_size)
                out = model.forward(params, buffers, x[rows])
                loss.index_add_(0, owner[rows], model.per_sample_loss(out, y[rows]).double())
                if classification:
                    hits = (out.argmax(-1) == y[rows]).double()
                    correct.index_add_(0, owner[rows], hits)
    finally:
        model.module.train()
    return [EvalCounts(float(loss[i]), float(correct[i]), n) for i, n in enumerate(sizes)]


def evaluate_stacked(
    model: FunctionalModel,
    models: list[Model],
    datas: list[ClientData],
    batch_size: int,
    chunk_size: int,
    device: torch.device | None = None,
) -> list[EvalCounts]:
    """Same numbers as :func:`evaluate_each`, computed ``chunk_size`` clients per vmapped call
    over test sets padded to a common length (padding has weight 0)."""
    dev = device or torch.device("cpu")
    classification = model.task == "classification"

    def one(
        params: Tree, buffers: Tree, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = model.forward(params, buffers, x)
        loss = (model.per_sample_loss(out, y) * w).sum()
        correct = ((out.argmax(-1) == y).to(w.dtype) * w).sum() if classification else loss * 0
        return loss, correct

    stacked = model.stacked()
    batched = vmap(one) if stacked is None else _stacked_counts(model, stacked, classification)
    counts: list[EvalCounts] = []
    model.module.eval()
    try:
        with torch.no_grad():
            for lo in range(0, len(models), chunk_size):
                part = range(lo, min(lo + chunk_size, len(models)))
                params = {
                    k: torch.stack([models[i][0][k] for i in part]).to(dev) for k in models[lo][0]
                }
                buffers = {
                    k: torch.stack([models[i][1][k] for i in part]).to(dev) for k in models[lo][1]
                }
                sizes = [datas[i].num_test for i in part]
                loss = torch.zeros(len(part), dtype=torch.float64)
                correct = torch.zeros(len(part), dtype=torch.float64)
                for start in range(0, max(sizes, default=0), batch_size):
                    width = min(batch_size, max(sizes) - start)
                    xb, yb, wb = _padded_slice([datas[i] for i in part], start, width)
                    lb, cb = batched(params, buffers, xb.to(dev), yb.to(dev), wb.to(dev))
                    loss += lb.double().cpu()
                    correct += cb.double().cpu()
                counts += [
                    EvalCounts(
                        float(loss[j]), float(correct[j]) if classification else 0.0, sizes[j]
                    )
                    for j in range(len(part))
                ]
    finally:
        model.module.train()
    return counts


def _padded_slice(
    datas: list[ClientData], start: int, width: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ref = datas[0]
    xb = ref.x_test.new_zeros((len(datas), width, *ref.x_test.shape[1:]))
    yb = ref.y_test.new_zeros((len(datas), width, *ref.y_test.shape[1:]))
    wb = torch.zeros(len(datas), width)
    for row, d in enumerate(datas):
        n = max(0, min(width, d.num_test - start))
        if n:
            xb[row, :n] = d.x_test[start : start + n]
            yb[row, :n] = d.y_test[start : start + n]
            wb[row, :n] = 1.0
    return xb, yb, wb


def _stacked_counts(
    model: FunctionalModel, stacked: StackedModel, classification: bool
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """The vmapped ``one`` of :func:`evaluate_stacked` on the stacked model (no ``vmap``)."""

    def counts(
        params: Tree, buffers: Tree, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = stacked.forward(params, x)
        flat_y = y.reshape(-1, *y.shape[2:])
        loss = (model.per_sample_loss(out, flat_y).view(w.shape) * w).sum(1)
        if not classification:
            return loss, loss * 0
        hits = (out.argmax(-1) == flat_y).view(w.shape).to(w.dtype)
        return loss, (hits * w).sum(1)

    return counts
