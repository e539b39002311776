"""Shared data of the vertical tests: fixed splits of scikit-learn's bundled datasets."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn.datasets import load_breast_cancer, load_diabetes
from sklearn.model_selection import train_test_split
from sklearn.preprocessing import StandardScaler

KEY_BITS = 1024
"""Tests only: production keys are 2048 bits or more."""


@pytest.fixture(scope="session")
def breast_cancer_split() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """breast_cancer: stratified 70/30 split with random_state 0, unscaled."""
    x, y = load_breast_cancer(return_X_y=True)
    return tuple(train_test_split(x, y, test_size=0.3, random_state=0, stratify=y))  # type: ignore[return-value]


@pytest.fixture(scope="session")
def breast_cancer_scaled(breast_cancer_split):
    """The same split, standardised with a scaler fit on the training rows."""
    x_tr, x_te, y_tr, y_te = breast_cancer_split
    scaler = StandardScaler().fit(x_tr)
    return scaler.transform(x_tr), scaler.transform(x_te), y_tr, y_te


@pytest.fixture(scope="session")
def diabetes_standardised() -> tuple[np.ndarray, np.ndarray]:
    """diabetes: all 442 rows, X and y standardised."""
    x, y = load_diabetes(return_X_y=True)
    x = StandardScaler().fit_transform(x)
    return x, (y - y.mean()) / y.std()
