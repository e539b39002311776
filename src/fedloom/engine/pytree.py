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
        acc = torch.zeros(first.shape, dtype=torch.float64)
        for tree, w in zip(trees, weights, strict=True):
            acc.add_(tree[key].to(torch.float64), alpha=float(w) / total)
        out[key] = (
            acc.round().to(first.dtype) if not first.is_floating_point() else acc.to(first.dtype)
        )
    return out


def num_bytes(tree: Mapping[str, torch.Tensor] | None) -> int:
    """Size of a message on the wire: the raw bytes of its tensors."""
    if not tree:
        return 0
    return sum(v.numel() * v.element_size() for v in tree.values())


def sq_norm(tree: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return sum((v.to(torch.float64) ** 2).sum() for v in tree.values() if v.is_floating_point())
