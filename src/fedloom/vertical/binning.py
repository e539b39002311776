"""Quantile cuts and bins, exactly as XGBoost's ``hist`` booster makes them
(docs/vertical.md, exactness items 3-4).

Each party sketches its own columns with XGBoost itself
(``QuantileDMatrix(X_party, max_bin=B).get_quantile_cut()``; the sketch is per column, so a
party's cuts equal those of the full matrix). The cuts are copied, never re-derived: the first
cut may lie below every value and a feature may get B + 1 bins. bin(x) = index of the first cut
strictly greater than float32(x), clamped to the last bin; the split candidate after bin b has
threshold cut[b] and sends x < cut[b] left.

Missing values (NaN) take no bin: they get the index ``max_bins`` (one past every feature's
last bin), which the histograms leave out. A backward candidate at bin b (missing values go
left, Chen & Guestrin 2016, Algorithm 3) splits at the lower bound of bin b: cut[b − 1], or
for b = 0 XGBoost's minimum value mval − |mval| − 1e-5 (float32; ``quantile.cc``), below
every training value, so that only the missing instances go left.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def _xgboost():
    try:
        import xgboost
    except ImportError as err:  # pragma: no cover - the vertical extra installs it
        raise ImportError(
            "SecureBoost takes its quantile cuts from xgboost: pip install 'fedloom[vertical]'"
        ) from err
    return xgboost


@dataclass(frozen=True)
class QuantileCuts:
    """Per-feature cut values (XGBoost's CSR layout: feature k's cuts are
    ``values[indptr[k]:indptr[k+1]]``)."""

    indptr: np.ndarray
    values: np.ndarray
    min_values: np.ndarray
    """Per feature: the split value below every training value (module docstring)."""

    @classmethod
    def sketch(cls, x: np.ndarray, max_bin: int) -> QuantileCuts:
        """XGBoost's own quantile sketch of the columns of ``x`` (NaN: missing)."""
        xgb = _xgboost()
        x32 = np.asarray(x, dtype=np.float32)
        dm = xgb.QuantileDMatrix(x32, max_bin=max_bin, nthread=1)
        indptr, values = dm.get_quantile_cut()
        mins = np.full(x32.shape[1], np.float32(1e-5), dtype=np.float32)  # an empty column's
        for k in range(x32.shape[1]):
            present = x32[~np.isnan(x32[:, k]), k]
            if present.size:
                mval = np.min(present)
                mins[k] = mval - np.abs(mval) - np.float32(1e-5)
        return cls(np.asarray(indptr, dtype=np.int64), np.asarray(values, dtype=np.float32), mins)

    @property
    def n_features(self) -> int:
        return len(self.indptr) - 1

    def n_bins(self, feature: int) -> int:
        return int(self.indptr[feature + 1] - self.indptr[feature])

    @property
    def max_bins(self) -> int:
        return int(np.max(np.diff(self.indptr)))

    def feature_cuts(self, feature: int) -> np.ndarray:
        return self.values[self.indptr[feature] : self.indptr[feature + 1]]

    def threshold(self, feature: int, bin_index: int, default_left: bool = False) -> float:
        """The split value of a candidate (x < it goes left): after bin ``bin_index`` (forward
        scan), or at its lower bound (backward scan, ``default_left``)."""
        if not default_left:
            return float(self.feature_cuts(feature)[bin_index])
        if bin_index == 0:
            return float(self.min_values[feature])
        return float(self.feature_cuts(feature)[bin_index - 1])

    @property
    def missing_bin(self) -> int:
        """The index missing entries get (left out of every histogram)."""
        return self.max_bins

    def bin(self, x: np.ndarray) -> np.ndarray:
        """Bin index per entry of ``x`` (n × features), int32; NaN: :attr:`missing_bin`."""
        x32 = np.asarray(x, dtype=np.float32)
        out = np.empty(x32.shape, dtype=np.int32)
        for k in range(self.n_features):
            cuts = self.feature_cuts(k)
            idx = np.searchsorted(cuts, x32[:, k], side="right")
            out[:, k] = np.where(
                np.isnan(x32[:, k]), self.missing_bin, np.minimum(idx, len(cuts) - 1)
            )
        return out


def goes_left(x: np.ndarray, threshold: float, default_left: bool) -> np.ndarray:
    """XGBoost's decision: float32(x) < threshold goes left; a missing x goes the default way."""
    x32 = np.asarray(x, dtype=np.float32)
    return np.where(np.isnan(x32), bool(default_left), x32 < np.float32(threshold))
