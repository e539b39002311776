"""Gradient-boosted trees the way XGBoost's ``hist`` booster grows them
(docs/vertical.md, exactness items 1, 2 and 5-8; Chen & Guestrin 2016, eq. 7): the
objectives' gradients, the split gain, the leaf weight and the candidate scan, shared by
SecureBoost's plaintext and encrypted paths.

- Missing values (Chen & Guestrin 2016, Algorithm 3, sparsity-aware split finding): the
  histograms hold the non-missing instances only. Every feature is scanned forward (left =
  bins <= b, the missing instances go right); a feature that has missing instances at the
  node is also scanned backward (right = bins >= b, the missing go left, the split value is
  the lower bound of bin b), and the backward candidate replaces the forward one only when
  strictly better (XGBoost's ``EnumerateSplit<+1>`` then ``<-1>``; among backward ties the
  higher bin, the first met).

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

from collections.abc import Sequence
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
    default_left: bool = False
    """Where missing values go: forward candidates send them right, backward ones left."""


@dataclass(frozen=True)
class Scan:
    """Every feature's best candidate at a node (one entry per histogram row): loss_chg
    (float32, −inf when no bin is valid), bin, G_L, H_L and the default direction."""

    loss_chg: np.ndarray
    bins: np.ndarray
    grad_left: np.ndarray
    hess_left: np.ndarray
    default_left: np.ndarray

    def best(self) -> Candidate | None:
        """The best (feature, bin, default direction) of the block, the lower feature on
        ties; None when no candidate is valid."""
        if self.loss_chg.size == 0:
            return None
        k = int(np.argmax(self.loss_chg))
        return self.candidate(k) if np.isfinite(self.loss_chg[k]) else None

    def candidate(self, k: int) -> Candidate:
        return Candidate(
            float(self.loss_chg[k]),
            k,
            int(self.bins[k]),
            float(self.grad_left[k]),
            float(self.hess_left[k]),
            bool(self.default_left[k]),
        )


def _split_gain(
    p: TreeParams, gl: np.ndarray, hl: np.ndarray, gr: np.ndarray, hr: np.ndarray, root: float
) -> np.ndarray:
    """float32 loss_chg of (left, right) sums, −inf where the split is not valid."""
    mcw = p.min_child_weight
    valid = (hl >= mcw) & (hr >= mcw) & (hl != 0) & (hr != 0)
    chg = (calc_gain(p, gl, hl) + calc_gain(p, gr, hr) - root).astype(np.float32)
    return np.where(valid, chg, np.float32(-np.inf))


def scan_features(
    p: TreeParams,
    hist_g: np.ndarray,
    hist_h: np.ndarray,
    node_g: float,
    node_h: float,
    missing: np.ndarray | None = None,
) -> Scan:
    """Every feature's best candidate at a node from its (features × bins) histograms of the
    non-missing instances; ``missing[k]``: feature k lacks a value for some instance of the
    node (then it is also scanned backward, module docstring)."""
    gl = np.cumsum(hist_g, axis=1)
    hl = np.cumsum(hist_h, axis=1)
    root_gain = np.float64(np.float32(calc_gain(p, np.float64(node_g), np.float64(node_h))))
    chg = _split_gain(p, gl, hl, node_g - gl, node_h - hl, root_gain)
    best_bin = np.argmax(chg, axis=1)  # first maximum: the lower bin wins ties
    rows = np.arange(chg.shape[0])
    scan = Scan(
        chg[rows, best_bin],
        best_bin,
        gl[rows, best_bin],
        hl[rows, best_bin],
        np.zeros(chg.shape[0], dtype=bool),
    )
    if missing is None or not np.any(missing):
        return scan
    m = np.flatnonzero(missing)
    right_g = np.cumsum(hist_g[m, ::-1], axis=1)[:, ::-1]  # Σ of bins >= b, summed downwards
    right_h = np.cumsum(hist_h[m, ::-1], axis=1)[:, ::-1]
    left_g, left_h = node_g - right_g, node_h - right_h
    back = _split_gain(p, left_g, left_h, right_g, right_h, root_gain)
    n_bins = back.shape[1]
    bb = n_bins - 1 - np.argmax(back[:, ::-1], axis=1)  # the first maximum met going down
    at = np.arange(len(m))
    better = back[at, bb] > scan.loss_chg[m]  # strictly: the forward candidate wins ties
    k, b = m[better], bb[better]
    scan.loss_chg[k] = back[at, bb][better]
    scan.bins[k] = b
    scan.grad_left[k] = left_g[at[better], b]
    scan.hess_left[k] = left_h[at[better], b]
    scan.default_left[k] = True
    return scan


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
    default_left: bool | None = None
    """Guest splits: where a missing value goes (a host keeps its own splits' direction)."""

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
                out |= {
                    "feature": self.feature,
                    "threshold": self.threshold,
                    "default_left": bool(self.default_left),
                }
        return out


@dataclass
class Tree:
    nodes: list[Node] = field(default_factory=list)

    @property
    def n_leaves(self) -> int:
        return sum(n.is_leaf for n in self.nodes)

    def to_dict(self) -> dict[str, Any]:
        return {"nodes": [n.to_dict() for n in self.nodes]}


OBJECTIVES = ("binary:logistic", "reg:squarederror", "multi:softprob")


class Objective:
    """A twice-differentiable loss on float32 margins, as XGBoost computes it:
    ``binary:logistic``, ``reg:squarederror`` and ``multi:softprob`` (``num_class`` margins
    per row, one tree per class and boosting round; ``multiclass_obj.cu``)."""

    def __init__(self, name: str, num_class: int | None = None) -> None:
        if name not in OBJECTIVES:
            raise ValueError(f"objective must be one of {', '.join(OBJECTIVES)}, got {name}")
        if (name == "multi:softprob") != (num_class is not None):
            raise ValueError("num_class is required by multi:softprob, and only by it")
        if num_class is not None and num_class < 2:
            raise ValueError(f"num_class must be at least 2, got {num_class}")
        self.name = name
        self.num_class = num_class

    @property
    def is_binary(self) -> bool:
        return self.name == "binary:logistic"

    @property
    def is_multiclass(self) -> bool:
        return self.num_class is not None

    @property
    def n_outputs(self) -> int:
        """Margins per row, hence trees per boosting round."""
        return self.num_class or 1

    def base_margin(self, base_score: float | Sequence[float]) -> np.ndarray:
        """The initial margin per output: logit(base_score) (logistic), base_score itself
        otherwise (multi-class: one per class, or one for all)."""
        scores = np.broadcast_to(np.asarray(base_score, dtype=np.float64), (self.n_outputs,))
        if self.is_binary:
            b = float(scores[0])
            if not 0.0 < b < 1.0:
                raise ValueError(f"base_score must lie in (0, 1) for binary:logistic: {b}")
            return np.array([np.log(b / (1.0 - b))], dtype=np.float32)
        return scores.astype(np.float32)

    def default_base_score(self, y: np.ndarray) -> float | list[float]:
        """XGBoost >= 2.0 estimates it from the labels: their mean; multi-class (3.x): the
        log class frequencies minus their mean (pass it explicitly for bit-equal runs
        across versions)."""
        if not self.is_multiclass:
            return float(np.mean(y))
        freq = np.bincount(y.astype(np.int64), minlength=self.n_outputs) / len(y)
        logs = np.log(np.maximum(freq, 1e-16))
        return [float(v) for v in logs - logs.mean()]

    def check_labels(self, y: np.ndarray) -> None:
        """Multi-class labels are the integers 0 .. num_class − 1."""
        if self.is_multiclass:
            k = self.n_outputs
            if not np.all((y == np.round(y)) & (y >= 0) & (y < k)):
                raise ValueError(f"multi:softprob needs integer labels in [0, {k}) (num_class)")

    def grad_hess(self, margin: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """float32 g, h at ``margin`` (n, or n × num_class): σ(m) − y, max(σ(1−σ), 1e-16);
        m − y, 1; or softmax p − [y = k], max(2p(1 − p), 1e-16)."""
        m = margin.astype(np.float32)
        y32 = y.astype(np.float32)
        one = np.float32(1.0)
        if self.is_multiclass:
            wmax = np.maximum(np.max(m, axis=1), np.finfo(np.float32).tiny)[:, None]
            e = np.exp(m - wmax)  # float32, as expf
            wsum = np.sum(e.astype(np.float64), axis=1, keepdims=True).astype(np.float32)
            prob = e / wsum
            h = np.maximum(np.float32(2.0) * prob * (one - prob), MIN_HESSIAN)
            onehot = np.arange(self.n_outputs)[None, :] == y.astype(np.int64)[:, None]
            return np.where(onehot, prob - one, prob), h
        if self.is_binary:
            pred = one / (one + np.exp(-m))
            return pred - y32, np.maximum(pred * (one - pred), MIN_HESSIAN)
        return m - y32, np.ones_like(m)

    def transform(self, margin: np.ndarray) -> np.ndarray:
        """Probabilities (softmax rows for multi-class) or the regression prediction."""
        if self.is_multiclass:
            z = margin.astype(np.float64)
            z = np.exp(z - z.max(axis=1, keepdims=True))
            return z / z.sum(axis=1, keepdims=True)
        if self.is_binary:
            return 1.0 / (1.0 + np.exp(-margin.astype(np.float64)))
        return margin.astype(np.float64)

    def loss(self, margin: np.ndarray, y: np.ndarray) -> float:
        """Mean log loss (binary, multi-class) or half the mean squared error."""
        m = margin.astype(np.float64)
        if self.is_multiclass:
            z = m - m.max(axis=1, keepdims=True)
            logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
            return float(-np.mean(logp[np.arange(len(y)), y.astype(np.int64)]))
        if self.is_binary:
            return float(np.mean(np.logaddexp(0.0, m) - y * m))
        return float(0.5 * np.mean((m - y) ** 2))
