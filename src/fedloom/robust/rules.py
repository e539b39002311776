"""Byzantine-robust aggregation rules on a matrix of client vectors (one row per client).

- coordinate median and trimmed mean: Yin et al., "Byzantine-Robust Distributed Learning:
  Towards Optimal Statistical Rates", ICML 2018, Definitions 1 and 2;
- Krum and Multi-Krum: Blanchard et al., "Machine Learning with Adversaries: Byzantine Tolerant
  Gradient Descent", NeurIPS 2017, section 4 (score_i = sum of squared distances to the
  n - f - 2 closest other vectors; needs n > 2f + 2);
- Bulyan: El Mhamdi et al., "The Hidden Vulnerability of Distributed Learning in Byzantium",
  ICML 2018, section 4 (theta = n - 2f vectors chosen by repeated Krum, then per coordinate the
  mean of the beta = theta - 2f values closest to the median; needs n >= 4f + 3);
- norm clipping: Sun et al., "Can You Really Backdoor Federated Learning?", 2019 (every vector
  scaled to norm <= M, then averaged, optionally with Gaussian noise).

All are permutation invariant (ties in Krum's scores break towards the vector that is
lexicographically smallest, not the lower index). Arithmetic in float64.
"""

from __future__ import annotations

import torch

from fedloom.errors import ConfigError


def coordinate_median(x: torch.Tensor) -> torch.Tensor:
    """Per coordinate, the median of the rows (the mean of the two middle values for an even
    number of rows)."""
    ordered = x.sort(dim=0).values
    n = x.shape[0]
    return (ordered[(n - 1) // 2] + ordered[n // 2]) / 2


def trimmed_mean(x: torch.Tensor, beta: float) -> torch.Tensor:
    """Per coordinate, the mean after dropping the floor(beta n) largest and smallest values."""
    n = x.shape[0]
    k = int(beta * n)
    if n - 2 * k < 1:
        raise ConfigError(f"aggregator.beta: {beta} trims all {n} clients (needs beta < 1/2)")
    return x.sort(dim=0).values[k : n - k].mean(dim=0)


def byzantine_error(rule: str, n: int, f: int) -> str | None:
    """Why ``n`` clients a round are too few for ``rule`` (krum, multi_krum, bulyan) to
    tolerate ``f``: Krum's precondition n > 2f + 2 (Blanchard et al., Proposition 1), Bulyan's
    n >= 4f + 3 (El Mhamdi et al., section 4); None when they suffice."""
    if rule == "bulyan" and n < 4 * f + 3:
        return (
            f"aggregator.kind bulyan with f={f} needs at least {4 * f + 3} clients "
            f"a round (n >= 4f + 3), got {n}"
        )
    if rule != "bulyan" and n <= 2 * f + 2:
        return (
            f"aggregator.kind {rule} with f={f} needs more than {2 * f + 2} clients "
            f"a round (n > 2f + 2), got {n}"
        )
    return None


def check_byzantine(rule: str, n: int, f: int) -> None:
    """ConfigError when ``n`` clients are too few for ``rule`` (``byzantine_error``)."""
    message = byzantine_error(rule, n, f)
    if message is not None:
        raise ConfigError(message)


def krum_scores(x: torch.Tensor, f: int) -> torch.Tensor:
    """score_i = sum of the squared distances from row i to its n - f - 2 nearest other rows."""
    n = x.shape[0]
    check_byzantine("krum", n, f)
    sq = (x * x).sum(dim=1)
    dist = (sq[:, None] + sq[None, :] - 2 * x @ x.T).clamp_min(0)
    dist.fill_diagonal_(float("inf"))
    return dist.sort(dim=1).values[:, : n - f - 2].sum(dim=1)


def _ranked(x: torch.Tensor, scores: torch.Tensor) -> list[int]:
    """Row indices by score, ties broken by the rows' values (so the result does not depend
    on the clients' order)."""
    keys = [(float(s), tuple(x[i, :8].tolist())) for i, s in enumerate(scores)]
    return sorted(range(len(keys)), key=lambda i: keys[i])


def multi_krum(x: torch.Tensor, f: int, m: int | None = None) -> torch.Tensor:
    """The mean of the m rows with the best Krum scores (m = 1: Krum; default m = n - f, as
    the Ditto authors' code)."""
    n = x.shape[0]
    m = n - f if m is None else m
    if not 1 <= m <= n:
        raise ConfigError(f"aggregator.m: {m} must be between 1 and the {n} clients")
    chosen = _ranked(x, krum_scores(x, f))[:m]
    return x[chosen].mean(dim=0)


def bulyan(x: torch.Tensor, f: int) -> torch.Tensor:
    """Bulyan over Krum: select theta = n - 2f rows by repeated Krum (each pick removed), then
    per coordinate average the beta = theta - 2f selected values closest to their median."""
    n = x.shape[0]
    check_byzantine("bulyan", n, f)
    remaining = list(range(n))
    selected: list[int] = []
    for _ in range(n - 2 * f):
        rows = x[remaining]
        if len(remaining) > 2 * f + 2:
            best = _ranked(rows, krum_scores(rows, f))[0]
        else:  # too few left for Krum's scores: the closest to the others in sum
            best = _ranked(rows, torch.cdist(rows, rows).pow(2).sum(dim=1))[0]
        selected.append(remaining.pop(best))
    chosen = x[selected]
    theta = chosen.shape[0]
    beta = theta - 2 * f
    median = coordinate_median(chosen)
    closest = (chosen - median).abs().argsort(dim=0)[:beta]
    return chosen.gather(0, closest).mean(dim=0)


def clip_rows(x: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Each row scaled to L2 norm at most ``max_norm``."""
    norms = x.norm(dim=1, keepdim=True)
    return x * (max_norm / norms.clamp_min(max_norm))


def median_norm(x: torch.Tensor) -> float:
    """The median of the rows' norms: the bound the Ditto authors' code clips to."""
    return float(coordinate_median(x.norm(dim=1, keepdim=True))[0])
