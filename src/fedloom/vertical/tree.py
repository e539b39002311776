"""Gradient-boosted trees the way XGBoost's ``hist`` booster grows them
(docs/vertical.md, exactness items 1, 2 and 5-8; Chen & Guestrin 2016, eq. 7): the
objectives' gradients, the split gain, the leaf weight and the candidate scan, shared by
SecureBoost's plaintext and encrypted paths.

- g, h, margins and leaf values are float32; histogram sums float64.
- CalcGain(G, H) = G²/(H + λ), 0 when H < min_child_weight; the split's
  loss_chg = float32(gain(G_L, H_L) + gain(G_R, H_R) − float32(gain(G, H))) with **no ½**, and
  gamma is compared with that un-halved value.
- A split is valid iff H_L, H_R >= min_child_weight (both non-zero), loss_chg > 1e-6,
  loss_chg >= gamma and depth < max_depth.
- Ties: the lower feature index (in the parties' global column order), then the lower bin.
- Leaf value = eta × (−G/(H + λ)) (0 when H < min_child_weight).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

RT_EPS = 1e-6
"""XGBoost's kRtEps: a split must gain more than this."""
MIN_HESSIAN = np.float32(1e-16)


@dataclass(frozen=True)
class TreeParams:
    """XGBoost's names and defaults (``param.h``)."""

    max_depth: int = 3
    eta: float = 0.3
    reg_lambda: float = 1.0
    gamma: float = 0.0
    min_child_weight: float = 1.0


def calc_gain(p: TreeParams, g: np.ndarray, h: np.ndarray) -> np.ndarray:
    """G²/(H + λ), 0 where H < min_child_weight (float64)."""
    g, h = np.asarray(g, dtype=np.float64), np.asarray(h, dtype=np.float64)
    gain = g * g / (h + p.reg_lambda)
    return np.where(h < p.min_child_weight, 0.0, gain)


def leaf_value(p: TreeParams, g: float, h: float) -> np.float32:
    """eta × (−G/(H + λ)) as float32 (0 below min_child_weight)."""
    if h < p.min_child_weight or h <= 0.0:
        return np.float32(0.0)
    return np.float32(np.float32(-g / (h + p.reg_lambda)) * np.float32(p.eta))


@dataclass(frozen=True)
class Candidate:
    """The best split of one party's histogram block at a node: loss_chg (float32), the
    feature (a local or opaque index), the bin, and the left child's (G, H)."""

    loss_chg: float
    feature: int
    bin: int
    grad_left: float
    hess_left: float


def scan_features(
    p: TreeParams, hist_g: np.ndarray, hist_h: np.ndarray, node_g: float, node_h: float
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Every feature's best candidate at a node: per row of the (features × bins) histograms,
    (loss_chg float32 or −inf when no bin is valid, best bin (first on ties), G_L, H_L)."""
    gl = np.cumsum(hist_g, axis=1)
    hl = np.cumsum(hist_h, axis=1)
    gr, hr = node_g - gl, node_h - hl
    mcw = p.min_child_weight
    valid = (hl >= mcw) & (hr >= mcw) & (hl != 0) & (hr != 0)
    root_gain = np.float64(np.float32(calc_gain(p, np.float64(node_g), np.float64(node_h))))
    chg = (calc_gain(p, gl, hl) + calc_gain(p, gr, hr) - root_gain).astype(np.float32)
    chg = np.where(valid, chg, np.float32(-np.inf))
    best_bin = np.argmax(chg, axis=1)  # first maximum: the lower bin wins ties
    rows = np.arange(chg.shape[0])
    return chg[rows, best_bin], best_bin, gl[rows, best_bin], hl[rows, best_bin]


def best_candidate(
    p: TreeParams, hist_g: np.ndarray, hist_h: np.ndarray, node_g: float, node_h: float
) -> Candidate | None:
    """The best (feature, bin) of a block, lower feature then lower bin on ties; None when no
    candidate is valid."""
    if hist_g.size == 0:
        return None
    chg, bins, gl, hl = scan_features(p, hist_g, hist_h, node_g, node_h)
    k = int(np.argmax(chg))
    if not np.isfinite(chg[k]):
        return None
    return Candidate(float(chg[k]), k, int(bins[k]), float(gl[k]), float(hl[k]))


def split_allowed(p: TreeParams, loss_chg: float, depth: int) -> bool:
    """XGBoost's final test of the best split (``expand_entry.h``)."""
    return loss_chg > RT_EPS and loss_chg >= p.gamma and depth < p.max_depth


@dataclass
class Node:
    """A node of the guest's tree. A split is either the guest's own (``feature``,
    ``threshold``) or a host's, known to the guest only as (``party``, ``record_id``)."""

    node_id: int
    depth: int
    grad: float
    hess: float
    party: int | None = None
    feature: int | None = None
    threshold: float | None = None
    record_id: int | None = None
    left: int | None = None
    right: int | None = None
    value: float | None = None

    @property
    def is_leaf(self) -> bool:
        return self.left is None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.node_id, "depth": self.depth}
        if self.is_leaf:
            out["leaf"] = self.value
        else:
            out |= {"party": self.party, "left": self.left, "right": self.right}
            if self.record_id is not None:
                out["record_id"] = self.record_id
            else:
                out |= {"feature": self.feature, "threshold": self.threshold}
        return out


@dataclass
class Tree:
    nodes: list[Node] = field(default_factory=list)

    @property
    def n_leaves(self) -> int:
        return sum(n.is_leaf for n in self.nodes)

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": [n.to_dict() for n in self.nodes]}


class Objective:
    """A twice-differentiable loss on float32 margins (XGBoost's ``binary:logistic`` and
    ``reg:squarederror``)."""

    def __init__(self, name: str) -> None:
        if name not in ("binary:logistic", "reg:squarederror"):
            raise ValueError(f"objective must be binary:logistic or reg:squarederror, got {name}")
        self.name = name

    @property
    def is_binary(self) -> bool:
        return self.name == "binary:logistic"

    def base_margin(self, base_score: float) -> np.float32:
        """The initial margin: logit(base_score) (logistic) or base_score itself."""
        if self.is_binary:
            if not 0.0 < base_score < 1.0:
                raise ValueError(f"base_score must lie in (0, 1) for binary:logistic: {base_score}")
            return np.float32(np.log(base_score / (1.0 - base_score)))
        return np.float32(base_score)

    def default_base_score(self, y: np.ndarray) -> float:
        """XGBoost >= 2.0 estimates it from the labels: their mean (pass it explicitly for
        bit-equal runs across versions)."""
        return float(np.mean(y))

    def grad_hess(self, margin: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 g, h at ``margin``: σ(m) − y, max(σ(1−σ), 1e-16); or m − y, 1."""
        m = margin.astype(np.float32)
        y32 = y.astype(np.float32)
        if self.is_binary:
            one = np.float32(1.0)
            pred = one / (one + np.exp(-m))
            return pred - y32, np.maximum(pred * (one - pred), MIN_HESSIAN)
        return m - y32, np.ones_like(m)

    def transform(self, margin: np.ndarray) -> np.ndarray:
        if self.is_binary:
            return 1.0 / (1.0 + np.exp(-margin.astype(np.float64)))
        return margin.astype(np.float64)
