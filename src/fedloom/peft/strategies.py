"""The server-side math of federated PEFT, as pure functions over factors and parameter dicts
(docs/peft.md).

Notation: client k holds A_k (r x in) and B_k (out x r) of each LoRA target, with weight p_k
(sum 1); its update of the frozen W0 is s B_k A_k. The exact global update is
sum_k p_k B_k A_k; FedIT's avg(B) avg(A) misses it by the cross terms.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from fedloom.core.pytree import Tree

A, B = "lora_A", "lora_B"


def normalized(weights: Sequence[float]) -> list[float]:
    total = float(sum(weights))
    if total <= 0:
        raise ValueError("aggregation weights must have a positive sum")
    return [float(w) / total for w in weights]


def weighted_sum(tensors: Sequence[torch.Tensor], p: Sequence[float]) -> torch.Tensor:
    out = torch.zeros_like(tensors[0])
    for t, w in zip(tensors, p, strict=True):
        out.add_(t, alpha=float(w))
    return out


# -- LoRA: which factors stay home ----------------------------------------------------------
def personal_keys(keys: Sequence[str], share: str, kind: str, head: str) -> set[str]:
    """The parameter keys that stay on each client: B for share a (FedSA-LoRA, Guo et al.
    2025), A for share b, the personal prompt, and the head when ``head`` is personal."""
    suffix = {"a": "." + B, "b": "." + A}.get(share) if kind == "lora" else None
    out = {k for k in keys if suffix is not None and k.endswith(suffix)}
    if kind == "prompt":
        out |= {k for k in keys if k == "prompts.personal"}
    if head == "personal":
        out |= {k for k in keys if k.startswith("classifier.")}
    return out


def lora_modules(keys: Sequence[str]) -> list[str]:
    """Prefixes of the LoRA targets in a key list (``lora.0.query`` for ``lora.0.query.lora_B``)."""
    return sorted({k.rsplit(".", 1)[0] for k in keys if k.endswith("." + B)})


# -- exactness ------------------------------------------------------------------------------
def exact_product(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], p: Sequence[float]
) -> torch.Tensor:
    """sum_k p_k B_k A_k: the update the clients' adapters represent together."""
    return weighted_sum([bk @ ak for ak, bk in zip(a, b, strict=True)], p)


def fedit(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], p: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """FedIT / naive LoRA-FedAvg: (avg A, avg B), each weighted by p (inexact: docs/peft.md;
    Wang et al., FLoRA, NeurIPS 2024)."""
    return weighted_sum(a, p), weighted_sum(b, p)


def flora_stack(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], p: Sequence[float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """FLoRA (Wang et al., NeurIPS 2024, sec. 3.2): B_stack = [p_1 B_1 ... p_K B_K],
    A_stack = [A_1; ...; A_K], so B_stack A_stack = sum_k p_k B_k A_k for any ranks r_k."""
    b_stack = torch.cat([w * bk for bk, w in zip(b, p, strict=True)], dim=1)
    return torch.cat(list(a), dim=0), b_stack


def fedex_residual(
    a: Sequence[torch.Tensor], b: Sequence[torch.Tensor], p: Sequence[float]
) -> torch.Tensor:
    """FedEx-LoRA (Singhal et al., 2024, eq. 5): sum_k p_k B_k A_k - avg(B) avg(A), the term
    added to the frozen weight so that avg(B) avg(A) + residual is exact."""
    a_bar, b_bar = fedit(a, b, p)
    return exact_product(a, b, p) - b_bar @ a_bar


# -- HetLoRA --------------------------------------------------------------------------------
def rank_by_size(n: int, n_max: int, r_max: int) -> int:
    """fedloom's size rule (docs/peft.md): r_k = floor(r_max log(n_k + 1) / log(n_max + 1)),
    at least 1."""
    if n_max <= 0:
        return r_max
    return max(1, min(r_max, math.floor(r_max * math.log(n + 1) / math.log(n_max + 1))))


def truncate(a: torch.Tensor, b: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Client k's rank-r factors of the server's rank-r_max ones: the first r rows of A and
    columns of B (HetLoRA, Cho et al. 2024, sec. 3)."""
    return a[:r], b[:, :r]


def pad(a: torch.Tensor, b: torch.Tensor, r_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Zero-pad rank-r factors to r_max (the inverse of :func:`truncate`; B A unchanged)."""
    r = a.shape[0]
    return (
        torch.cat([a, a.new_zeros(r_max - r, a.shape[1])], dim=0),
        torch.cat([b, b.new_zeros(b.shape[0], r_max - r)], dim=1),
    )


def rank_mask(t: torch.Tensor, r: int, dim: int) -> torch.Tensor:
    """``t`` with entries past rank r along ``dim`` zeroed: truncation at full shape, so that
    every client's factors keep one shape and the vmap backend can stack them."""
    keep = (torch.arange(t.shape[dim], device=t.device) < r).to(t.dtype)
    shape = [1] * t.ndim
    shape[dim] = -1
    return t * keep.view(shape)


def hetlora_weights(
    uploads: Sequence[Tree], modules: Sequence[str], p: Sequence[float]
) -> list[float]:
    """HetLoRA's sparsity-weighted aggregation: weights proportional to p_k ||B_k A_k||_F
    (over all targets), normalized; the plain weights p when every product is zero."""
    norms = []
    for up in uploads:
        sq = sum(float((up[f"{m}.{B}"] @ up[f"{m}.{A}"]).square().sum()) for m in modules)
        norms.append(math.sqrt(sq))
    raw = [w * n for w, n in zip(p, norms, strict=True)]
    return normalized(raw) if sum(raw) > 0 else list(p)


# -- prompts --------------------------------------------------------------------------------
def spherical_mean(
    prompts: Sequence[torch.Tensor], p: Sequence[float], eps: float = 1e-12
) -> torch.Tensor:
    """The geometry-aware (spherical) aggregate of K prompts (L x d; docs/peft.md): per token, the
    weighted mean of the unit directions, renormalized, at the weighted mean norm (for K = 2 and
    equal norms it points like SLERP's midpoint)."""
    stacked = torch.stack(list(prompts))
    w = torch.tensor(list(p), dtype=stacked.dtype).view(-1, 1, 1)
    norms = stacked.norm(dim=-1, keepdim=True)
    direction = (w * stacked / norms.clamp_min(eps)).sum(0)
    direction = direction / direction.norm(dim=-1, keepdim=True).clamp_min(eps)
    return direction * (w * norms).sum(0)


def slerp(p0: torch.Tensor, p1: torch.Tensor, t: float, eps: float = 1e-7) -> torch.Tensor:
    """Spherical interpolation of two prompts token by token (direction by SLERP, norm linear)."""
    n0, n1 = p0.norm(dim=-1, keepdim=True), p1.norm(dim=-1, keepdim=True)
    u0, u1 = p0 / n0.clamp_min(eps), p1 / n1.clamp_min(eps)
    omega = torch.arccos((u0 * u1).sum(-1, keepdim=True).clamp(-1 + eps, 1 - eps))
    so = torch.sin(omega)
    u = (torch.sin((1 - t) * omega) * u0 + torch.sin(t * omega) * u1) / so
    return u * ((1 - t) * n0 + t * n1)
