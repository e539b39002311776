"""Quantile cuts and bins, exactly as XGBoost's ``hist`` booster makes them
(docs/vertical.md, exactness items 3-4).

Each party sketches its own columns with XGBoost itself
(``QuantileDMatrix(X_party, max_bin=B).get_quantile_cut()``; the sketch is per column, so a
party's cuts equal those of the full matrix). The cuts are copied, never re-derived: the first
cut may lie below every value and a feature may get B + 1 bins. bin(x) = index of the first cut
strictly greater than float32(x), clamped to the last bin; the split candidate after bin b has
threshold cut[b] and sends x < cut[b] left.
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

    @classmethod
    def sketch(cls, x: np.ndarray, max_bin: int) -> QuantileCuts:
        """XGBoost's own quantile sketch of the columns of ``x``."""
        xgb = _xgboost()
        dm = xgb.QuantileDMatrix(np.asarray(x, dtype=np.float32), max_bin=max_bin, nthread=1)
        indptr, values = dm.get_quantile_cut()
        return cls(np.asarray(indptr, dtype=np.int64), np.asarray(values, dtype=np.float32))

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

    def threshold(self, feature: int, bin_index: int) -> float:
        """The split value of the candidate after bin ``bin_index``: x < it goes left."""
        return float(self.feature_cuts(feature)[bin_index])

    def bin(self, x: np.ndarray) -> np.ndarray:
        """Bin index per entry of ``x`` (n × features), int32."""
        x32 = np.asarray(x, dtype=np.float32)
        out = np.empty(x32.shape, dtype=np.int32)
        for k in range(self.n_features):
            cuts = self.feature_cuts(k)
            idx = np.searchsorted(cuts, x32[:, k], side="right")
            out[:, k] = np.minimum(idx, len(cuts) - 1)
        return out
