"""FLI (Yu et al. 2020; docs/incentives.md): the closed form on a hand-computed round, budget
balance and equivariance, and the queue dynamics at three budgets against the four baselines
(equal split, by sample count, Shapley-proportional, cost only)."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest

from fedloom.incentives.book import IncentiveBook
from fedloom.incentives.fairness import jain_index, spearman
from fedloom.incentives.fli import Ledger, RoundInput, fli_weights, pay_round

# three participants: contribution q, regret Y, waiting Q, cost c, mean cost so far
Q_HAT = {0: 0.5, 1: 0.25, 2: 1.0}
Y = {0: 1.0, 1: 0.0, 2: 0.5}
WAIT = {0: 0.0, 1: 2.0, 2: 0.0}
COST = {0: 1.0, 1: 2.0, 2: 0.5}


def round_input() -> RoundInput:
    return RoundInput([0, 1, 2], dict(COST), dict(Q_HAT), {0: 1, 1: 1, 2: 1}, dict(COST))


def test_closed_form_by_hand():
    """omega 2, B 3, R 1. lambda = mean cost while Y > 0: (1, 0, 0.5).
    u* = 1/2 (2q + Y + c + Q + lambda) = (2, 2.25, 1.75), sum 6, u = 3 u*/6 = (1, 1.125, 0.875);
    Y' = max(Y + c - u, 0) = (1, 0.875, 0.125); Q' = max(Q + lambda - u, 0) = (0, 0.875, 0)."""
    ledger = Ledger(dict(Y), dict(WAIT))
    pay = pay_round(ledger, fli_weights(2.0), round_input(), 3.0, 1)
    assert pay == pytest.approx({0: 1.0, 1: 1.125, 2: 0.875}, abs=1e-12)
    assert ledger.regret == pytest.approx({0: 1.0, 1: 0.875, 2: 0.125}, abs=1e-12)
    assert ledger.waiting == pytest.approx({0: 0.0, 1: 0.875, 2: 0.0}, abs=1e-12)
    assert sum(pay.values()) == 3.0


def test_sub_rounds_by_hand():
    """R = 2: two sub-budgets of 1.5, the cost charged in the first only, lambda = mean cost
    / 2 while Y > 0; the same recursion in exact rational arithmetic."""
    F = Fraction
    y = {i: F(v) for i, v in Y.items()}
    w = {i: F(v) for i, v in WAIT.items()}
    total = dict.fromkeys(y, F(0))
    for r in range(2):
        c = {i: F(COST[i]) if r == 0 else F(0) for i in y}
        lam = {i: F(COST[i]) / 2 if y[i] > 0 else F(0) for i in y}
        star = {i: (2 * F(Q_HAT[i]) + y[i] + c[i] + w[i] + lam[i]) / 2 for i in y}
        u = {i: F(3, 2) * star[i] / sum(star.values()) for i in y}
        y = {i: max(y[i] + c[i] - u[i], F(0)) for i in y}
        w = {i: max(w[i] + lam[i] - u[i], F(0)) for i in y}
        total = {i: total[i] + u[i] for i in y}
    ledger = Ledger(dict(Y), dict(WAIT))
    pay = pay_round(ledger, fli_weights(2.0), round_input(), 3.0, 2)
    for i in y:
        assert pay[i] == pytest.approx(float(total[i]), abs=1e-12)
        assert ledger.regret[i] == pytest.approx(float(y[i]), abs=1e-12)
        assert ledger.waiting[i] == pytest.approx(float(w[i]), abs=1e-12)
    assert sum(pay.values()) == pytest.approx(3.0, abs=1e-12)


def test_identical_participants_get_identical_pay():
    n = 4
    inputs = RoundInput(
        list(range(n)),
        dict.fromkeys(range(n), 1.3),
        dict.fromkeys(range(n), 0.2),
        dict.fromkeys(range(n), 10),
        dict.fromkeys(range(n), 1.3),
    )
    ledger = Ledger()
    for _ in range(3):
        pay = pay_round(ledger, fli_weights(1.0), inputs, 2.0, 5)
        assert all(u >= 0 for u in pay.values())
        assert len(set(pay.values())) == 1
        assert sum(pay.values()) == pytest.approx(2.0, abs=1e-12)


def simulate(fraction: float, omega: float, rounds: int = 100):
    """The FLI dynamics of docs/incentives.md, "Measured": 10 owners, c ~ U[0.5, 2],
    q ~ U[0, 1] (NumPy seed 0), T = 100, R = 1."""
    rng = np.random.default_rng(0)
    c, q = rng.uniform(0.5, 2.0, 10), rng.uniform(0.0, 1.0, 10)
    n = rng.integers(100, 1000, 10)
    book = IncentiveBook(
        ["fli", "equal", "samples", "shapley", "cost"], fraction * c.sum(), omega, 1
    )
    totals = []
    for t in range(1, rounds + 1):
        book.pay(t, dict(enumerate(c)), dict(enumerate(q)), dict(enumerate(n)))
        totals.append(sum(book.ledgers["fli"].regret.values()))
    return book, c, q, totals


def var_regret(book: IncentiveBook, scheme: str) -> float:
    return float(np.var(list(book.ledgers[scheme].regret.values())))


def test_dynamics_at_three_budgets():
    rich, c, _, _ = simulate(1.5, 1.0)
    assert all(y == 0 for y in rich.ledgers["fli"].regret.values())
    poor, c, _, totals = simulate(0.5, 1.0)
    assert all(y > 0 for y in poor.ledgers["fli"].regret.values())
    assert np.diff(totals)[-10:] == pytest.approx([0.5 * c.sum()] * 10, rel=1e-9)
    tight, _, _, _ = simulate(0.8, 1.0)
    fli = var_regret(tight, "fli")  # measured 92.6; equal 948.5, Shapley 2276.9
    assert fli == pytest.approx(92.58, abs=0.01)
    for baseline in ("equal", "samples", "shapley"):
        assert fli <= 0.15 * var_regret(tight, baseline), baseline


def test_omega_trades_fairness_for_contribution():
    """At B = 1.5 sum c: pay net of cost follows contribution (Spearman 0.98 at omega 10),
    and the regret spread grows with omega (measured 0.00, 0.11, 32.1)."""
    spreads = []
    for omega in (1.0, 10.0, 100.0):
        book, _, q, _ = simulate(1.5, omega)
        spreads.append(var_regret(book, "fli"))
        if omega == 10.0:
            net = [book.ledgers["fli"].paid[i] - book.cost[i] for i in range(10)]
            assert spearman(net, list(q)) == pytest.approx(0.976, abs=0.01)
    assert spreads[0] == 0.0 and 0.05 < spreads[1] < 0.2 and 20 < spreads[2] < 50


def test_fairness_helpers():
    assert jain_index([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert spearman([1, 2, 3, 4], [10, 20, 30, 25]) == pytest.approx(0.8)
    assert spearman([1, 1], [1, 2]) is None


def test_book_state_round_trips():
    book, _, _, _ = simulate(0.8, 1.0, rounds=5)
    again = IncentiveBook(book.schemes, book.budget, book.omega, book.sub_rounds)
    again.load_state_dict(book.state_dict())
    assert again.summary() == book.summary()
