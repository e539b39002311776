"""Shapley estimators (docs/incentives.md, "Contribution: the game of a round"): the axioms on
exact values, the glove and additive games, and TMC/GTG over all permutations equal to exact."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from fedloom.incentives.shapley import (
    CachedGame,
    Convergence,
    exact_shapley,
    gtg_shapley,
    leave_one_out,
    rescale_to_gain,
    tmc_shapley,
)


def random_game(n: int, seed: int):
    """v(S): an arbitrary value per coalition (v(0) arbitrary too)."""
    rng = np.random.default_rng(seed)
    table = {
        c: float(rng.normal()) for k in range(n + 1) for c in itertools.combinations(range(n), k)
    }
    return lambda s: table[s]


def glove(s):
    """Player 0 holds a left glove, players 1 and 2 a right one: a pair is worth 1."""
    left = sum(1 for p in s if p == 0)
    return float(min(left, len(s) - left))


def test_glove_game():
    phi = exact_shapley(glove, [0, 1, 2]).raw
    assert phi == pytest.approx({0: 2 / 3, 1: 1 / 6, 2: 1 / 6}, abs=1e-12)


def test_efficiency_symmetry_dummy_additivity():
    n = 6
    v, w = random_game(n, 0), random_game(n, 1)
    phi_v = exact_shapley(v, range(n))
    assert math.fsum(phi_v.raw.values()) == pytest.approx(v(tuple(range(n))) - v(()), abs=1e-12)
    assert phi_v.evaluations == 2**n
    phi_w = exact_shapley(w, range(n)).raw
    both = exact_shapley(lambda s: v(s) + w(s), range(n)).raw
    for i in range(n):
        assert both[i] == pytest.approx(phi_v.raw[i] + phi_w[i], abs=1e-12)

    # player 3 is a dummy (adds nothing), players 0 and 1 are interchangeable
    def sym(s):
        core = tuple(p for p in s if p != 3)
        key = tuple(sorted({0: 1, 1: 0}.get(p, p) for p in core))
        return v(core) + v(key)

    phi = exact_shapley(sym, range(n)).raw
    assert phi[3] == pytest.approx(0.0, abs=1e-12)
    assert phi[0] == pytest.approx(phi[1], abs=1e-12)


def test_additive_game_gives_its_weights():
    a = {0: 0.3, 1: -0.2, 2: 1.5, 3: 0.0}

    def additive(s):
        return 7.0 + sum(a[p] for p in s)

    assert exact_shapley(additive, a).raw == pytest.approx(a, abs=1e-12)
    assert leave_one_out(additive, a).raw == pytest.approx(a, abs=1e-12)


def test_all_permutations_without_truncation_are_exact():
    n = 5
    v = random_game(n, 2)
    exact = exact_shapley(v, range(n)).raw
    orders = list(itertools.permutations(range(n)))
    tmc = tmc_shapley(v, range(n), np.random.default_rng(0), tolerance=0.0, orders=orders)
    gtg = gtg_shapley(
        v, range(n), np.random.default_rng(0), tolerance=0.0, round_tolerance=0.0, orders=orders
    )
    assert tmc.permutations == gtg.permutations == math.factorial(n)
    for i in range(n):
        assert tmc.raw[i] == pytest.approx(exact[i], abs=1e-12)
        assert gtg.raw[i] == pytest.approx(exact[i], abs=1e-12)


def test_truncation_skips_evaluations():
    """Once a prefix is within the tolerance of v(N) the walk stops evaluating: a game that
    saturates after the first player costs n + 1 evaluations per guided sweep at most."""
    calls = CachedGame(lambda s: 1.0 if s else 0.0)
    result = gtg_shapley(calls, range(8), np.random.default_rng(0))
    assert calls.evaluations == 2 + 8  # N, empty, and each player alone
    assert result.raw == pytest.approx({i: 1 / 8 for i in range(8)})
    assert sum(result.reported.values()) == pytest.approx(1.0)


def test_round_truncation_and_rescaling():
    flat = gtg_shapley(lambda s: 0.5 + 1e-4 * len(s), range(4), np.random.default_rng(0))
    assert flat.truncated and flat.reported == dict.fromkeys(range(4), 0.0)
    assert flat.evaluations == 2
    assert rescale_to_gain({0: 2.0, 1: -1.0, 2: 2.0}, 1.0) == {0: 0.5, 1: -0.25, 2: 0.5}
    assert rescale_to_gain({0: 2.0, 1: -4.0}, -1.0) == {0: 0.5, 1: -1.0}


def test_convergence_bounds():
    assert Convergence().bounds(8) == (30, 205)
    assert Convergence().bounds(3) == (30, 8)
    assert Convergence(maximum=50).bounds(12) == (30, 50)


def test_monte_carlo_estimators_approach_exact():
    """TMC and GTG without truncation, sampling until their convergence rule: near the exact
    values of a 6-player game whose values are far from 0 (relative L1 under 0.15; measured
    0.110 for TMC after 30 permutations, 0.065 for GTG after 36)."""
    n = 6
    rng = np.random.default_rng(5)
    weight = rng.uniform(0.5, 2.0, n)

    def v(s):  # superadditive: a weighted sum, squared
        return float(sum(weight[list(s)])) ** 2 / 10

    exact = exact_shapley(v, range(n)).raw
    scale = sum(abs(x) for x in exact.values())
    for estimator in (tmc_shapley, gtg_shapley):
        got = estimator(v, range(n), np.random.default_rng(0), tolerance=0.0)
        assert got.permutations >= 30
        assert sum(abs(got.raw[i] - exact[i]) for i in range(n)) / scale < 0.15
