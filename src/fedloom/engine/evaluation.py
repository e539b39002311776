"""Evaluation of many clients' deployed models on their own held-out data: one at a time, or
C at a time under ``vmap`` (the personalized evaluation PFL runs do every few rounds)."""

from __future__ import annotations

import torch
from torch.func import vmap

from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.core.pytree import Tree
from fedloom.engine.metrics import EvalCounts

Model = tuple[Tree, Tree]


def evaluate_each(
    model: FunctionalModel, models: list[Model], datas: list[ClientData], batch_size: int
) -> list[EvalCounts]:
    return [
        EvalCounts(*model.evaluate(p, b, d.x_test, d.y_test, batch_size))
        for (p, b), d in zip(models, datas, strict=True)
    ]


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

    batched = vmap(one)
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
