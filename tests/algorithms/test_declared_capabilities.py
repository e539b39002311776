"""Capabilities are declared, not detected: an algorithm that defines a local correction says
so with ``has_correction`` (the client programs skip the call otherwise)."""

from __future__ import annotations

import pytest

from fedloom.algorithms import ALGORITHMS
from fedloom.algorithms.base import Algorithm


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_an_algorithm_with_a_local_correction_declares_it(name):
    cls = ALGORITHMS.get(name)
    if cls.local_correction is Algorithm.local_correction:
        return
    assert cls.has_correction is not Algorithm.has_correction, (
        f"{name} defines local_correction but not has_correction: its term would be skipped"
    )
