"""Training-health measurements for the report and the dashboard (docs/monitoring.md: convergence
health, personalization effect, heterogeneity, resources).

Per evaluated round (``eval.every``, so the cost is paid only when metrics are written), from
the round's reporting clients and the server's model:

- update norms ||Delta_k|| of the clients' round updates (Delta_k: what the client's round
  moved, ``Wire.delta``, algorithms/wire.py) as min / P10 / P50 / P90 / max / mean, and per client;
- the pairwise cosine similarity matrix cos(Delta_i, Delta_j) of up to ``monitor.clients``
  reporting clients (shown as a heatmap in the report);
- the gradient dissimilarity (the global variance sigma_g^2 of Reddi et al., ICLR 2021,
  arXiv:2003.00295, Assumption 3; the zeta^2 of Koloskova et al., ICML 2020, arXiv:2003.10422)::

      zeta^2 = 1/K sum_k || grad F_k(w) - grad F(w) ||^2,   grad F(w) = sum_k n_k/n grad F_k(w)

  at the current global model w (convergence bounds often take it at the optimum w*, unknown
  during training), with
  full-data gradients on a fixed sample of up to ``monitor.clients`` training clients.

Once per run, from the partition (heterogeneity of the data itself):

- label-distribution KL(P_k || P) of each client's label distribution to the pooled one (nats);
- each client's number of test samples (``test_samples``), which the accuracy-collapse alert
  needs (docs/monitoring.md, "Alerts": a client with 5 test samples moves 20 points per sample);
- feature-distribution Jensen–Shannon divergence (base 2, in [0, 1]) of each client's input
  value histogram to the pooled one (32 bins over the pooled range for real-valued inputs,
  token counts for integer inputs): cheap and model-free.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedloom.core.functional import FunctionalModel
from fedloom.core.protocol import ClientData
from fedloom.core.pytree import Tree
from fedloom.engine.threads import torch_threads

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
        cosine = cosine_matrix([flat[c] for c in ids])
    return {
        "update_norm": quantiles(list(norms.values())),
        "client_update_norm": {str(c): n for c, n in norms.items()},
        "cosine": {"clients": ids, "matrix": cosine},
    }


def cosine_matrix(vectors: list[torch.Tensor]) -> list[list[float | None]]:
    """Pairwise cosine similarities (None where a vector is zero), in float64 with torch's
    own reductions on one thread: the same bits whatever executor and thread count the run
    uses (a BLAS product's summation order depends on both, and on memory alignment)."""
    with torch_threads(1):
        rows = [v.double() for v in vectors]
        lengths = [float(torch.linalg.vector_norm(v)) for v in rows]
        out: list[list[float | None]] = [[None] * len(rows) for _ in rows]
        for i, a in enumerate(rows):
            for j in range(i, len(rows)):
                denom = lengths[i] * lengths[j]
                value = float((a * rows[j]).sum()) / denom if denom > 0 else None
                out[i][j] = out[j][i] = value
    return out


def gradient_dissimilarity(
    model: FunctionalModel, params: Tree, buffers: Tree, clients: dict[int, ClientData]
) -> float | None:
    """zeta^2 = 1/K sum_k ||g_k - g||^2 with g = sum_k n_k/n g_k (the module doc)."""
    datas = [d for d in clients.values() if d.num_train > 0]
    if not datas:
        return None
    sizes = [d.num_train for d in datas]
    if model.stacked() is not None and not buffers and not model.has_dropout:
        g = stacked_full_gradients(model, params, datas)
    else:
        g = torch.stack(
            [flatten(model.full_gradient(params, buffers, d.x_train, d.y_train)) for d in datas]
        )
    w = torch.tensor(sizes, dtype=torch.float64)
    mean = (w[:, None] * g).sum(0) / w.sum()
    return float(((g - mean) ** 2).sum(1).mean())


def stacked_full_gradients(
    model: FunctionalModel, params: Tree, datas: list[ClientData], chunk: int = 16
) -> torch.Tensor:
    """Each client's full-data gradient of its mean loss at ``params``, flattened (one row
    per client): ``chunk`` clients at once on the stacked model (core/stacked.py), each
    client's training set one minibatch padded with weight 0."""
    stacked = model.stacked()
    assert stacked is not None
    rows = []
    for lo in range(0, len(datas), chunk):
        part = datas[lo : lo + chunk]
        width = max(d.num_train for d in part)
        ref = part[0]
        x = ref.x_train.new_zeros((len(part), width, *ref.x_train.shape[1:]))
        y = ref.y_train.new_zeros((len(part), width, *ref.y_train.shape[1:]))
        w = torch.zeros(len(part), width)
        for i, d in enumerate(part):
            x[i, : d.num_train], y[i, : d.num_train], w[i, : d.num_train] = d.x_train, d.y_train, 1
        expanded = {k: v.unsqueeze(0).expand(len(part), *v.shape) for k, v in params.items()}
        grads, _ = stacked.value_and_grad(expanded, x, y, w, model.per_sample_loss)
        flat = [grads.materialize(k).reshape(len(part), -1).double() for k in sorted(params)]
        rows.append(torch.cat(flat, 1))
    return torch.cat(rows)


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


def test_samples(clients: dict[int, ClientData]) -> dict[str, int]:
    """Each client's number of test samples (what its personalized accuracy is measured on)."""
    return {str(c): d.num_test for c, d in clients.items()}


def _js_bits(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """JS divergence (bits) of each row of ``p`` to the distribution ``q``."""
    m = (p + q) / 2

    def kl(a: torch.Tensor) -> torch.Tensor:
        return torch.where(a > 0, a * (a / m).log2(), 0.0).sum(-1)

    return (kl(p) + kl(q.expand_as(p))) / 2


def feature_js(clients: dict[int, ClientData]) -> dict[str, float]:
    """JS divergence (bits) of each client's input-value histogram to the pooled one. The
    histograms are one table and the divergences one batched computation: once per run, but
    100,000 clients one at a time took 10 s (docs/population.md)."""
    xs = {c: d.x_train for c, d in clients.items() if d.num_train > 0}
    if not xs:
        return {}
    if all(x.is_floating_point() for x in xs.values()):
        lo = float(torch.stack([x.min() for x in xs.values()]).min())
        hi = float(torch.stack([x.max() for x in xs.values()]).max())
        hi = hi if hi > lo else lo + 1.0

        def hist(x: torch.Tensor) -> torch.Tensor:
            return torch.histc(x.double().reshape(-1), FEATURE_BINS, lo, hi)
    else:
        size = int(torch.stack([x.max() for x in xs.values()]).max()) + 1

        def hist(x: torch.Tensor) -> torch.Tensor:
            return torch.bincount(x.long().reshape(-1), minlength=size).double()

    hists = torch.stack([hist(x) for x in xs.values()])
    total = hists.sum(0)  # counts: exact in float64 in any order
    js = _js_bits(hists / hists.sum(1, keepdim=True), total / total.sum())
    return dict(zip(map(str, xs), js.tolist(), strict=True))
