"""Operations on parameter trees: flat ``dict[str, Tensor]`` maps, the currency of every
algorithm's messages and states."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

Tree = dict[str, torch.Tensor]


def clone(tree: Mapping[str, torch.Tensor]) -> Tree:
    return {k: v.detach().clone() for k, v in tree.items()}


def zeros_like(tree: Mapping[str, torch.Tensor]) -> Tree:
    return {k: torch.zeros_like(v) for k, v in tree.items()}


def add(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor], alpha: float = 1.0) -> Tree:
    """a + alpha * b."""
    return {k: a[k] + alpha * b[k] for k in a}


def sub(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> Tree:
    return {k: a[k] - b[k] for k in a}


def scale(a: Mapping[str, torch.Tensor], factor: float) -> Tree:
    return {k: factor * v for k, v in a.items()}


def select(tree: Mapping[str, torch.Tensor], keys: Sequence[str]) -> Tree:
    return {k: tree[k] for k in keys}


def weighted_average(trees: Sequence[Mapping[str, torch.Tensor]], weights: Sequence[float]) -> Tree:
    """sum_k w_k tree_k / sum_k w_k, accumulated in float64 and cast back, key by key.

    Integer tensors (e.g. BatchNorm's ``num_batches_tracked``) are averaged and rounded.
    """
    if not trees:
        raise ValueError("weighted_average of no trees")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("weighted_average: weights must sum to a positive number")
    out: Tree = {}
    for key, first in trees[0].items():
        narrow = first.numel() * 8 * WEIGHTED_ROWS_MIN_BLOCK <= WEIGHTED_ROWS_BLOCK_BYTES
        stacked = _rows_of_one_tensor([tree[key] for tree in trees]) if narrow else None
        if stacked is not None and first.is_floating_point():
            out[key] = _weighted_rows(stacked, weights, total).to(first.dtype).view(first.shape)
            continue
        acc = torch.zeros(first.shape, dtype=torch.float64)
        for tree, w in zip(trees, weights, strict=True):
            # add_ promotes float32 to the float64 accumulator without a converted copy
            # (bit-identical to adding .to(float64), and faster: benchmarks/README.md,
            # Design measurements)
            acc.add_(tree[key], alpha=float(w) / total)
        out[key] = (
            acc.round().to(first.dtype) if not first.is_floating_point() else acc.to(first.dtype)
        )
    return out


def _rows_of_one_tensor(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensor whose rows 0, 1, ..., n-1 ``tensors`` are, in order (the vectorized
    executor hands back each client's parameters as rows of one stacked tensor); None when
    they are not."""
    base = tensors[0]._base
    if base is None or base.dim() == 0 or base.shape[0] != len(tensors):
        return None
    if not base.is_contiguous() or tensors[0].shape != base.shape[1:]:
        return None
    ptr, step = base.data_ptr(), base.stride(0) * base.element_size()
    for i, t in enumerate(tensors):
        if t._base is not base or t.data_ptr() != ptr + i * step:
            return None
    return base


WEIGHTED_ROWS_BLOCK_BYTES = 1 << 20
WEIGHTED_ROWS_MIN_BLOCK = 16
"""Rows of one stacked tensor are averaged a block at a time when at least this many fit in
WEIGHTED_ROWS_BLOCK_BYTES as float64; wider rows go one by one, which is faster for them
(benchmarks/README.md, Design measurements)."""


def _weighted_rows(stacked: torch.Tensor, weights: Sequence[float], total: float) -> torch.Tensor:
    """sum_i w_i stacked[i] / total in float64, a block of rows at a time (matrix-vector
    products on float64 copies of about 1 MB), faster than row by row for many narrow rows
    (benchmarks/README.md, Design measurements)."""
    rows = stacked.reshape(stacked.shape[0], -1)
    w = torch.tensor(list(weights), dtype=torch.float64) / total
    acc = torch.zeros(rows.shape[1], dtype=torch.float64)
    block = max(1, WEIGHTED_ROWS_BLOCK_BYTES // (8 * max(1, rows.shape[1])))
    for lo in range(0, rows.shape[0], block):
        acc.addmv_(rows[lo : lo + block].to(torch.float64).T, w[lo : lo + block])
    return acc


def num_bytes(tree: Mapping[str, torch.Tensor] | None) -> int:
    """Size of a message on the wire: the raw bytes of its tensors."""
    if not tree:
        return 0
    return sum(v.numel() * v.element_size() for v in tree.values())


def flatten64(tree: Mapping[str, torch.Tensor], keys: Sequence[str]) -> torch.Tensor:
    """The tensors at ``keys``, in that order, as one float64 vector (robust rules and secure
    aggregation work on these)."""
    return torch.cat([tree[k].detach().double().reshape(-1) for k in keys])


def unflatten(vector: torch.Tensor, like: Mapping[str, torch.Tensor], keys: Sequence[str]) -> Tree:
    """``flatten64``'s inverse: ``vector`` cut into the shapes (and dtypes) of ``like[keys]``."""
    out: Tree = {}
    offset = 0
    for k in keys:
        ref = like[k]
        out[k] = vector[offset : offset + ref.numel()].reshape(ref.shape).to(ref.dtype)
        offset += ref.numel()
    return out
