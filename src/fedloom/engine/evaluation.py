"""Evaluation of many clients' deployed models on their own held-out data: one at a time, or
C at a time under ``vmap`` (the personalized evaluation PFL runs do every few rounds)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import torch
from torch.func import vmap

from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.core.pytree import Tree
from fedloom.core.stacked import StackedModel
from fedloom.engine.metrics import EvalCounts

Model = tuple[Tree, Tree]

Batch = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""Inputs, targets and each sample's weight (0: padding)."""


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

    def batches(part: range) -> Iterator[Batch]:
        longest = max((datas[i].num_test for i in part), default=0)
        for start in range(0, longest, batch_size):
            width = min(batch_size, longest - start)
            yield _padded_slice([datas[i] for i in part], start, width)

    sums = vmapped_sums(model, models, batches, chunk_size, device or torch.device("cpu"))
    classification = model.task == "classification"
    return [
        EvalCounts(loss, correct if classification else 0.0, d.num_test)
        for (loss, correct), d in zip(sums, datas, strict=True)
    ]


def evaluate_shared(
    model: FunctionalModel, models: list[Model], data: ClientData, batch_size: int, chunk_size: int
) -> list[EvalCounts]:
    """Many models (contribution evaluation's coalition models) on one held-out set:
    ``chunk_size`` models per vmapped forward over the same batches, no copies of the data per
    model; on the device the models live on."""

    def batches(part: range) -> Iterator[Batch]:
        for start in range(0, data.num_test, batch_size):
            x = data.x_test[start : start + batch_size]
            yield x, data.y_test[start : start + batch_size], torch.ones(x.shape[0])

    device = next(iter(models[0][0].values())).device if models else torch.device("cpu")
    sums = vmapped_sums(model, models, batches, chunk_size, device, shared=True)
    return [EvalCounts(loss, correct, data.num_test) for loss, correct in sums]


def vmapped_sums(
    model: FunctionalModel,
    models: list[Model],
    batches: Callable[[range], Iterable[Batch]],
    chunk_size: int,
    device: torch.device,
    shared: bool = False,
) -> list[tuple[float, float]]:
    """The one vmapped evaluator: (summed loss, correct predictions) of each model, its
    parameters stacked ``chunk_size`` models at a time, over the weighted batches (x, y, w)
    that ``batches(chunk)`` yields, one per model (a leading model axis) or, ``shared``, one
    for all of them. A module with a stacked form (core/stacked.py) runs without ``vmap``."""
    classification = model.task == "classification"
    stacked = None if shared else model.stacked()
    if stacked is not None:
        batched = _stacked_counts(model, stacked, classification)
    else:
        dims = (0, 0, None, None, None) if shared else 0
        batched = vmap(_weighted_counts(model, classification), in_dims=dims)
    out: list[tuple[float, float]] = []
    model.module.eval()
    try:
        with torch.no_grad():
            for lo in range(0, len(models), chunk_size):
                part = range(lo, min(lo + chunk_size, len(models)))
                params, buffers = (_stacked([models[i][j] for i in part], device) for j in (0, 1))
                loss = torch.zeros(len(part), dtype=torch.float64)
                correct = torch.zeros(len(part), dtype=torch.float64)
                for xb, yb, wb in batches(part):
                    lb, cb = batched(params, buffers, xb.to(device), yb.to(device), wb.to(device))
                    loss += lb.double().cpu()
                    correct += cb.double().cpu()
                out += [(float(loss[j]), float(correct[j])) for j in range(len(part))]
    finally:
        model.module.train()
    return out


def _stacked(trees: list[Tree], device: torch.device) -> Tree:
    return {k: torch.stack([t[k] for t in trees]).to(device) for k in trees[0]}


def _weighted_counts(
    model: FunctionalModel, classification: bool
) -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """One model's weighted loss sum and hits on one batch (what :func:`vmapped_sums` maps)."""

    def one(
        params: Tree, buffers: Tree, x: torch.Tensor, y: torch.Tensor, w: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = model.forward(params, buffers, x)
        loss = (model.per_sample_loss(out, y) * w).sum()
        correct = ((out.argmax(-1) == y).to(w.dtype) * w).sum() if classification else loss * 0
        return loss, correct

    return one


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
    """The vmapped :func:`_weighted_counts` on the stacked model (no ``vmap``)."""

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
