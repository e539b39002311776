"""Vertically partitioned data: the same aligned samples, features split into the parties'
column blocks; party 0 (the guest, or active party) holds the labels.

Built-in datasets need no download: scikit-learn's ``breast_cancer`` (binary, 569 × 30),
``diabetes`` (regression, 442 × 10), ``wine`` (3 classes, 178 × 13) and ``digits`` (10
classes, 1797 × 64). Their test split is
``train_test_split(test_size=test_fraction, random_state=seed, stratify=y)`` (no stratify for
regression), features standardised with a scaler fit on the training rows (issue #16); with
``missing_fraction`` a seeded share of the feature entries is then blanked (NaN). Rows are
assumed aligned by id already: private set intersection is out of scope.

Federated transfer learning uses a different layout (:func:`transfer_split`): two parties with
partly overlapping rows (docs/vertical.md, worked example).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

import numpy as np

from fedloom.core.rng import numpy_rng
from fedloom.errors import ConfigError, DataError

DATASETS = {
    "breast_cancer": "binary",
    "diabetes": "regression",
    "wine": "multiclass",
    "digits": "multiclass",
}
"""Built-in datasets and their task."""


@dataclass
class VerticalData:
    """Train and test rows of every party (``parts[0]`` is the guest's block) and the guest's
    labels. ``y_scale``: (mean, std) when the regression target was standardised."""

    name: str
    task: str
    train_parts: list[np.ndarray]
    y_train: np.ndarray
    test_parts: list[np.ndarray]
    y_test: np.ndarray
    columns: list[tuple[int, int]] = field(default_factory=list)
    y_scale: tuple[float, float] | None = None

    @classmethod
    def from_arrays(
        cls,
        train_parts: Sequence[np.ndarray],
        y_train: np.ndarray,
        test_parts: Sequence[np.ndarray],
        y_test: np.ndarray,
        name: str = "arrays",
    ) -> VerticalData:
        """User arrays, already aligned and split: integer labels mean a binary task (0/1) or,
        with more than two values, a multi-class one (0 .. K − 1); floats a regression."""
        y_train = np.asarray(y_train)
        if np.issubdtype(y_train.dtype, np.floating):
            task = "regression"
        else:
            task = "multiclass" if len(np.unique(y_train)) > 2 else "binary"
        train = [np.asarray(p, dtype=np.float64) for p in train_parts]
        test = [np.asarray(p, dtype=np.float64) for p in test_parts]
        check_parts(train, len(y_train), allow_missing=True)  # the estimator decides
        check_parts(test, len(y_test), allow_missing=True)
        return cls(name, task, train, y_train.astype(np.float64), test, np.asarray(y_test, float))


def check_parts(
    parts: Sequence[np.ndarray], n_rows: int | None = None, *, allow_missing: bool = False
) -> list[np.ndarray]:
    """The parties' blocks as float64 matrices with one row count (raises ValueError); NaN
    (a missing value) only with ``allow_missing`` (SecureBoost), inf never."""
    if len(parts) < 2:
        raise ValueError(f"vertical data needs at least two parties' blocks, got {len(parts)}")
    out = [np.asarray(p, dtype=np.float64) for p in parts]
    for i, p in enumerate(out):
        if p.ndim != 2 or p.shape[1] == 0:
            raise ValueError(f"party {i}'s block must be a non-empty 2-D array, got {p.shape}")
        if np.any(np.isinf(p)):
            raise ValueError(f"party {i}'s block holds inf")
        if not allow_missing and np.any(np.isnan(p)):
            raise ValueError(
                f"party {i}'s block holds NaN: missing values are supported by secureboost only"
            )
    rows = {p.shape[0] for p in out} | ({n_rows} if n_rows is not None else set())
    if len(rows) != 1:
        raise ValueError(
            f"the parties' blocks (and labels) must have one row count (aligned ids), got "
            f"{sorted(rows)}"
        )
    return out


def check_columns(parties: Sequence[Sequence[int]], n_features: int) -> list[tuple[int, int]]:
    """Column ranges [start, end) per party: inside the data, non-empty, not overlapping."""
    ranges = []
    for i, r in enumerate(parties):
        if len(r) != 2 or not all(isinstance(v, int) for v in r):
            raise ConfigError(f"data.partition.parties[{i}]: expected [start, end), got {r!r}")
        start, end = r
        if not 0 <= start < end <= n_features:
            raise ConfigError(
                f"data.partition.parties[{i}] = [{start}, {end}): columns must satisfy "
                f"0 <= start < end <= {n_features}"
            )
        ranges.append((start, end))
    taken = sorted(ranges)
    for (_, end), (start, _) in pairwise(taken):
        if start < end:
            raise ConfigError(f"data.partition.parties: column ranges overlap ({taken})")
    if len(ranges) < 2:
        raise ConfigError("data.partition.parties: a vertical partition needs two parties")
    return ranges


def load_sklearn(name: str) -> tuple[np.ndarray, np.ndarray]:
    """Features and target of a built-in dataset (bundled with scikit-learn: no download)."""
    from sklearn import datasets

    if name not in DATASETS:
        raise DataError(
            f"unknown vertical dataset '{name}': built-in ones are {', '.join(DATASETS)}; "
            "bring other arrays with the Python API"
        )
    loader = getattr(datasets, f"load_{name}")
    x, y = loader(return_X_y=True)
    return np.asarray(x, dtype=np.float64), np.asarray(y)


def load_vertical(
    name: str,
    parties: Sequence[Sequence[int]],
    test_fraction: float,
    seed: int,
    standardize_target: bool = True,
    missing_fraction: float = 0.0,
) -> VerticalData:
    """The issue's split of a built-in dataset: stratified for classification, a scaler fit
    on the training rows; a regression target standardised the same way (undone for RMSE).
    ``missing_fraction``: each feature entry (train and test) is blanked to NaN with this
    probability, from the stream ``vertical_missing`` of ``seed`` (after scaling)."""
    from sklearn.model_selection import train_test_split
    from sklearn.preprocessing import StandardScaler

    x, y = load_sklearn(name)
    task = DATASETS[name]
    columns = check_columns(parties, x.shape[1])
    x_tr, x_te, y_tr, y_te = train_test_split(
        x,
        y,
        test_size=test_fraction,
        random_state=seed,
        stratify=y if task != "regression" else None,
    )
    scaler = StandardScaler().fit(x_tr)
    x_tr, x_te = scaler.transform(x_tr), scaler.transform(x_te)
    if missing_fraction > 0.0:
        rng = numpy_rng(seed, "vertical_missing")
        x_tr = np.where(rng.random(x_tr.shape) < missing_fraction, np.nan, x_tr)
        x_te = np.where(rng.random(x_te.shape) < missing_fraction, np.nan, x_te)
    y_scale = None
    if task == "regression":
        y_tr, y_te = y_tr.astype(np.float64), y_te.astype(np.float64)
        if standardize_target:
            y_scale = (float(y_tr.mean()), float(y_tr.std()))
            y_tr = (y_tr - y_scale[0]) / y_scale[1]
            y_te = (y_te - y_scale[0]) / y_scale[1]
    else:
        y_tr, y_te = y_tr.astype(np.float64), y_te.astype(np.float64)
    return VerticalData(
        name,
        task,
        [x_tr[:, a:b] for a, b in columns],
        y_tr,
        [x_te[:, a:b] for a, b in columns],
        y_te,
        columns,
        y_scale,
    )


@dataclass
class TransferData:
    """Federated transfer learning's layout (Liu et al. 2020): source A's rows with labels
    ±1, target B's rows, the overlap as pairs (A row, B row), which overlap pairs carry a
    label (D_c), and B-only test rows with their true labels (for evaluation only; B never
    sees them)."""

    x_a: np.ndarray
    y_a: np.ndarray
    x_b: np.ndarray
    overlap_a: np.ndarray
    overlap_b: np.ndarray
    labelled: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def transfer_split(
    x: np.ndarray,
    y: np.ndarray,
    columns: Sequence[Sequence[int]],
    rows_a: Sequence[int],
    rows_b: Sequence[int],
    labelled_rows: Sequence[int],
    seed: int,
    scale_on: str = "train",
) -> TransferData:
    """Rows permuted with ``RandomState(seed)``; A = rows_a with columns[0] and labels,
    B = rows_b with columns[1]; the overlap is rows_a ∩ rows_b, D_c the overlap rows in
    ``labelled_rows``; B's rows outside A are the test rows. ``scale_on``: fit the scaler on
    the training rows (A ∪ overlap; the issue's rule) or on ``all`` rows (the worked
    example of docs/vertical.md)."""
    from sklearn.preprocessing import StandardScaler

    a0, a1 = rows_a
    b0, b1 = rows_b
    c0, c1 = labelled_rows
    n = x.shape[0]
    if not (0 <= a0 < a1 <= n and 0 <= b0 < b1 <= n and a0 <= b0 < a1 < b1):
        raise ConfigError(
            f"rows_a={list(rows_a)}, rows_b={list(rows_b)}: need 0 <= a0 <= b0 < a1 < b1 <= {n} "
            "(A's rows, then an overlap, then B-only rows)"
        )
    if not b0 <= c0 < c1 <= a1:
        raise ConfigError(f"labelled_rows={list(labelled_rows)} must lie inside the overlap")
    perm = np.random.RandomState(seed).permutation(n)
    x, y = x[perm], y[perm]
    fit_rows = x if scale_on == "all" else x[a0:a1]
    x = StandardScaler().fit(fit_rows).transform(x)
    (ca0, ca1), (cb0, cb1) = columns
    ids = np.arange(n)
    overlap = ids[b0:a1]
    labelled = (overlap >= c0) & (overlap < c1)
    return TransferData(
        x_a=x[a0:a1, ca0:ca1],
        y_a=np.where(y[a0:a1] > 0, 1.0, -1.0),
        x_b=x[b0:b1, cb0:cb1],
        overlap_a=overlap - a0,
        overlap_b=overlap - b0,
        labelled=np.flatnonzero(labelled),
        x_test=x[a1:b1, cb0:cb1],
        y_test=np.where(y[a1:b1] > 0, 1.0, -1.0),
    )
