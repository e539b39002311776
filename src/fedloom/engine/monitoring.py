"""Training-health measurements for the report and the dashboard (seed 004, second article,
5.2, the monitoring table: convergence health, personalization effect, heterogeneity,
resources).

Per evaluated round (``eval.every``, so the cost is paid only when metrics are written), from
the round's reporting clients and the server's model:

- update norms ||Delta_k|| of the clients' round updates (Delta_k: what the client's round
  moved, ``Algorithm.client_delta``) as min / P10 / P50 / P90 / max / mean, and per client;
- the pairwise cosine similarity matrix cos(Delta_i, Delta_j) of up to ``monitor.clients``
  reporting clients (the seed's 参数余弦相似度矩阵热力图);
- the gradient dissimilarity (seed 004, 3.1)::

      zeta^2 = 1/K sum_k || grad F_k(w) - grad F(w) ||^2,   grad F(w) = sum_k n_k/n grad F_k(w)

  at the current global model w (the seed defines it at w*, unknown during training), with
  full-data gradients on a fixed sample of up to ``monitor.clients`` training clients.

Once per run, from the partition (heterogeneity of the data itself):

- label-distribution KL(P_k || P) of each client's label distribution to the pooled one (nats);
- feature-distribution Jensen–Shannon divergence (base 2, in [0, 1]) of each client's input
  value histogram to the pooled one (32 bins over the pooled range for real-valued inputs,
  token counts for integer inputs): cheap and model-free.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.core.pytree import Tree

FEATURE_BINS = 32
HETEROGENEITY_FILE = "heterogeneity.json"


def flatten(tree: Tree) -> torch.Tensor:
    """All floating tensors of ``tree`` as one float64 vector (keys in sorted order)."""
    parts = [tree[k].reshape(-1).double() for k in sorted(tree) if tree[k].is_floating_point()]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def quantiles(values: list[float]) -> dict[str, float | None]:
    """min / P10 / P50 / P90 / max / mean of ``values`` (None each when empty)."""
    keys = ["min", "p10", "p50", "p90", "max", "mean"]
    if not values:
        return dict.fromkeys(keys)
    v = np.asarray(values, dtype=float)
    q = np.percentile(v, [10, 50, 90])
    return {
        "min": float(v.min()),
        "p10": float(q[0]),
        "p50": float(q[1]),
        "p90": float(q[2]),
        "max": float(v.max()),
        "mean": float(v.mean()),
    }


def update_statistics(deltas: dict[int, Tree], max_clients: int) -> dict[str, Any]:
    """Norms of every client's update and the cosine matrix of the first ``max_clients`` (by
    client id)."""
    flat = {c: flatten(d) for c, d in sorted(deltas.items())}
    norms = {c: float(v.norm()) for c, v in flat.items()}
    ids = list(flat)[:max_clients]
    cosine: list[list[float | None]] = []
    if ids:
        stacked = torch.stack([flat[c] for c in ids])
        lengths = stacked.norm(dim=1)
        gram = stacked @ stacked.T
        denom = lengths[:, None] * lengths[None, :]
        matrix = torch.where(denom > 0, gram / denom.clamp_min(1e-300), torch.nan)
        cosine = [[None if math.isnan(x) else float(x) for x in row] for row in matrix.tolist()]
    return {
        "update_norm": quantiles(list(norms.values())),
        "client_update_norm": {str(c): n for c, n in norms.items()},
        "cosine": {"clients": ids, "matrix": cosine},
    }


def gradient_dissimilarity(
    model: FunctionalModel, params: Tree, buffers: Tree, clients: dict[int, ClientData]
) -> float | None:
    """zeta^2 = 1/K sum_k ||g_k - g||^2 with g = sum_k n_k/n g_k (the module doc)."""
    grads, sizes = [], []
    for data in clients.values():
        if data.num_train == 0:
            continue
        grads.append(flatten(model.full_gradient(params, buffers, data.x_train, data.y_train)))
        sizes.append(data.num_train)
    if not grads:
        return None
    g = torch.stack(grads)
    w = torch.tensor(sizes, dtype=torch.float64)
    mean = (w[:, None] * g).sum(0) / w.sum()
    return float(((g - mean) ** 2).sum(1).mean())


def label_kl(clients: dict[int, ClientData], num_classes: int) -> dict[str, float]:
    """KL(P_k || P) in nats of each client's training label distribution to the pooled one."""
    counts = {
        c: torch.bincount(d.y_train.long(), minlength=num_classes).double()
        for c, d in clients.items()
    }
    total = sum(counts.values())
    pooled = total / total.sum()
    out = {}
    for c, n in counts.items():
        if n.sum() == 0:
            continue
        p = n / n.sum()
        mask = p > 0
        out[str(c)] = float((p[mask] * (p[mask] / pooled[mask]).log()).sum())
    return out


def _js_bits(p: torch.Tensor, q: torch.Tensor) -> float:
    m = (p + q) / 2

    def kl(a: torch.Tensor) -> torch.Tensor:
        mask = a > 0
        return (a[mask] * (a[mask] / m[mask]).log2()).sum()

    return float((kl(p) + kl(q)) / 2)


def feature_js(clients: dict[int, ClientData]) -> dict[str, float]:
    """JS divergence (bits) of each client's input-value histogram to the pooled one."""
    xs = {c: d.x_train for c, d in clients.items() if d.num_train > 0}
    if not xs:
        return {}
    if all(x.is_floating_point() for x in xs.values()):
        lo = min(float(x.min()) for x in xs.values())
        hi = max(float(x.max()) for x in xs.values())
        hi = hi if hi > lo else lo + 1.0

        def hist(x: torch.Tensor) -> torch.Tensor:
            return torch.histc(x.double().reshape(-1), FEATURE_BINS, lo, hi)
    else:
        size = max(int(x.max()) for x in xs.values()) + 1

        def hist(x: torch.Tensor) -> torch.Tensor:
            return torch.bincount(x.long().reshape(-1), minlength=size).double()

    hists = {c: hist(x) for c, x in xs.items()}
    total = sum(hists.values())
    pooled = total / total.sum()
    return {str(c): _js_bits(h / h.sum(), pooled) for c, h in hists.items()}
