"""Capabilities are declared, not detected: an algorithm's local SGD differs from FedAvg's only
through the options of its program (``SGDProgram``: start, correction, momentum, lr, finish),
so a gradient correction that is not handed to the program cannot exist unused."""

from __future__ import annotations

import pytest

from fedloom.algorithms import ALGORITHMS
from fedloom.algorithms.base import Algorithm

FORMER_HOOKS = (
    "local_start",
    "local_correction",
    "local_lr",
    "local_momentum",
    "has_correction",
    "local_finish",
)


def test_the_fedavg_family_hooks_are_program_options_not_algorithm_methods():
    for hook in FORMER_HOOKS:
        assert not hasattr(Algorithm, hook), hook


@pytest.mark.parametrize("name", ALGORITHMS.names())
def test_an_algorithm_with_a_local_correction_hands_it_to_its_program(name):
    cls = ALGORITHMS.get(name)
    if getattr(cls, "local_correction", None) is None:
        return
    assert cls.make_program is not Algorithm.make_program, (
        f"{name} defines local_correction but its program is FedAvg's: the term would be skipped"
    )
