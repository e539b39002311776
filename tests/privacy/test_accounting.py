"""Accounting goes through Opacus: epsilon values of its RDP accountant (Mironov 2017;
Mironov, Talwar and Zhang 2019) recorded from opacus 1.6.0 (delta 1e-5, default orders), and
its noise calibration (docs/privacy.md)."""

from __future__ import annotations

import math

import pytest

from fedloom.privacy import epsilon, noise_multiplier_for

DELTA = 1e-5


@pytest.mark.parametrize(
    ("history", "expected"),
    [
        ([(1.1, 0.01, 10000)], 5.63199236854841),
        ([(1.0, 0.01, 1000)], 2.1013652716430564),
        ([(1.1, 0.004, 25000)], 3.3082409489753344),
        ([(1.0, 0.05, 500)], 8.296681394517947),
        ([(1.0, 0.01, 500), (2.0, 0.02, 500)], 1.8946132540122864),  # two phases
    ],
)
def test_epsilon_equals_opacus_rdp(history, expected):
    assert epsilon(history, DELTA, "rdp") == pytest.approx(expected, abs=1e-9)


def test_prv_is_tighter_than_rdp():
    prv = epsilon([(1.1, 0.01, 10000)], DELTA, "prv")
    assert prv == pytest.approx(5.20, abs=0.01)
    assert prv < epsilon([(1.1, 0.01, 10000)], DELTA, "rdp")


def test_no_steps_spend_nothing_and_no_noise_spends_everything():
    assert epsilon([], DELTA) == 0.0
    assert epsilon([(1.0, 0.01, 0)], DELTA) == 0.0
    assert math.isinf(epsilon([(0.0, 0.01, 10)], DELTA))


def test_noise_calibration_to_a_target_epsilon():
    sigma = noise_multiplier_for(8.0, DELTA, 0.01, 10000, "rdp")
    assert sigma == pytest.approx(0.9173583984375, abs=1e-12)
    assert epsilon([(sigma, 0.01, 10000)], DELTA) <= 8.0
