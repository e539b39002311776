"""Contribution of each participant to a cooperative game v(S): exact Shapley values,
leave-one-out, TMC-Shapley (Ghorbani & Zou, ICML 2019) and GTG-Shapley (Liu et al., ACM TIST
2022); docs/incentives.md, "Contribution: the game of a round".

A game is any callable ``v(coalition) -> float`` over sorted tuples of player ids, so the same
estimators value clients in an FL round (v(S): the validation metric of the model built from
S's uploads, engine/contribution.py) and the textbook games of the tests (glove, additive).
:class:`CachedGame` evaluates each coalition once and counts the distinct evaluations: the
cost measure by which the tests and benchmarks/incentives.py compare GTG with exact values.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

Coalition = tuple[int, ...]
Game = Callable[[Coalition], float]


class CachedGame:
    """``game`` with a cache keyed by the sorted coalition; ``evaluations`` counts the distinct
    coalitions evaluated (the empty one included). ``many``, when given, evaluates a list of
    coalitions at once (the engine's batched evaluation); ``prefetch`` uses it."""

    def __init__(
        self, game: Game, many: Callable[[list[Coalition]], list[float]] | None = None
    ) -> None:
        self.game = game
        self.many = many
        self.values: dict[Coalition, float] = {}

    @property
    def evaluations(self) -> int:
        return len(self.values)

    def __call__(self, coalition: Iterable[int]) -> float:
        key = tuple(sorted(coalition))
        if key not in self.values:
            self.values[key] = float(self.game(key))
        return self.values[key]

    def prefetch(self, coalitions: Iterable[Iterable[int]]) -> None:
        """Evaluate the coalitions not cached yet, in one call of ``many`` when given."""
        todo = list(dict.fromkeys(tuple(sorted(c)) for c in coalitions))
        todo = [c for c in todo if c not in self.values]
        if self.many is not None and todo:
            self.values.update(zip(todo, map(float, self.many(todo)), strict=True))
        for c in todo:
            self(c)


@dataclass
class Valuation:
    """One estimator's result for one game: ``raw`` the estimate; ``rescaled`` GTG's output
    after :func:`rescale_to_gain` (None for the other estimators); the cost in distinct
    coalition evaluations and permutations walked."""

    raw: dict[int, float]
    evaluations: int
    permutations: int = 0
    rescaled: dict[int, float] | None = None
    truncated: bool = False
    """GTG: the round was truncated as a whole (|v(N) - v(0)| <= delta: every value 0)."""
    gain: float = 0.0
    """v(N) - v(empty)."""

    @property
    def reported(self) -> dict[int, float]:
        """What the estimator reports: GTG's rescaled values, else the raw estimate."""
        return self.rescaled if self.rescaled is not None else self.raw


def _as_cached(game: Game | CachedGame) -> CachedGame:
    return game if isinstance(game, CachedGame) else CachedGame(game)


def shapley_weight(size: int, n: int) -> float:
    """|S|! (n - |S| - 1)! / n!: the weight of coalition S (|S| = size) in phi_i."""
    return math.factorial(size) * math.factorial(n - size - 1) / math.factorial(n)


def exact_shapley(game: Game | CachedGame, players: Sequence[int]) -> Valuation:
    """phi_i = sum_{S subset N minus i} |S|!(n-|S|-1)!/n! [v(S u i) - v(S)] over all 2^n
    coalitions (each evaluated once; batched through ``CachedGame.many``)."""
    v = _as_cached(game)
    players = sorted(players)
    n = len(players)
    every = [c for k in range(n + 1) for c in combinations(players, k)]
    v.prefetch(every)
    phi: dict[int, float] = {}
    for i in players:
        others = [p for p in players if p != i]
        terms = [
            shapley_weight(k, n) * (v((*s, i)) - v(s))
            for k in range(n)
            for s in combinations(others, k)
        ]
        phi[i] = math.fsum(terms)
    return Valuation(phi, v.evaluations, gain=v(players) - v(()))


def leave_one_out(game: Game | CachedGame, players: Sequence[int]) -> Valuation:
    """LOO_i = v(N) - v(N minus i): n + 2 evaluations (with the empty coalition's, for the
    gain)."""
    v = _as_cached(game)
    players = sorted(players)
    v.prefetch([(), tuple(players), *[[p for p in players if p != i] for i in players]])
    full = v(players)
    loo = {i: full - v([p for p in players if p != i]) for i in players}
    return Valuation(loo, v.evaluations, gain=full - v(()))


def walk_permutations(
    v: CachedGame,
    orders: Sequence[Sequence[int]],
    full: float,
    empty: float,
    tolerance: float,
) -> list[dict[int, float]]:
    """Marginal contributions along each permutation; once |v(N) - v(prefix)| < tolerance the
    rest of that walk's marginals are 0, without evaluating (TMC's and GTG's within-round
    truncation). The walks advance in lockstep, one position at a time, so the prefixes a
    position needs are evaluated in one ``prefetch`` (one batched call in the engine); the
    coalitions evaluated are the same as walking the permutations one after another."""
    marginals: list[dict[int, float]] = [{} for _ in orders]
    before = [empty] * len(orders)
    for k in range(len(orders[0]) if orders else 0):
        live = {j for j in range(len(orders)) if abs(full - before[j]) >= tolerance}
        v.prefetch([orders[j][: k + 1] for j in sorted(live)])
        for j, order in enumerate(orders):
            if j not in live:
                marginals[j][order[k]] = 0.0
                continue
            after = v(order[: k + 1])
            marginals[j][order[k]] = after - before[j]
            before[j] = after
    return marginals


@dataclass
class Convergence:
    """When a Monte-Carlo estimator stops (GTG's rule, also used for TMC): after at least
    ``minimum`` permutations (default max(30, n)), once for each of the last ``window``
    running means the mean over players of |mean_k - mean_last| / |mean_last| is at most
    ``criterion``; at the latest after ``maximum`` permutations (default, as the GTG
    authors' code: min(2^n, max(minimum, ceil(0.8 * 2^n))))."""

    criterion: float = 0.05
    window: int = 10
    minimum: int | None = None
    maximum: int | None = None

    def bounds(self, n: int) -> tuple[int, int]:
        low = self.minimum if self.minimum is not None else max(30, n)
        if self.maximum is not None:
            return low, self.maximum
        return low, min(2**n, max(low, math.ceil(0.8 * 2**n)))

    def done(self, means: list[np.ndarray], n: int) -> bool:
        low, high = self.bounds(n)
        count = len(means)
        if count >= high:
            return True
        if count < low or count < self.window:
            return False
        last = means[-1]
        recent = np.stack(means[-self.window :])
        errors = np.mean(np.abs(recent - last) / (np.abs(last) + 1e-12), axis=1)
        return bool(np.max(errors) <= self.criterion)


def _monte_carlo(
    v: CachedGame,
    players: list[int],
    orders: Iterable[Sequence[int]],
    tolerance: float,
    convergence: Convergence | None,
    block: int,
) -> tuple[dict[int, float], int]:
    """The mean marginal contributions over ``orders``, walked ``block`` permutations at a
    time; ``convergence`` (None: walk every order) is checked after each block."""
    full, empty = v(players), v(())
    total = np.zeros(len(players))
    means: list[np.ndarray] = []
    index = {p: k for k, p in enumerate(players)}
    source = iter(orders)
    count = 0
    while True:
        high = convergence.bounds(len(players))[1] if convergence is not None else None
        room = block if high is None else min(block, high - count)
        chunk = list(itertools.islice(source, max(room, 0)))
        if not chunk:
            break
        for marginal in walk_permutations(v, chunk, full, empty, tolerance):
            for p, m in marginal.items():
                total[index[p]] += m
            count += 1
            means.append(total / count)
        if convergence is not None and convergence.done(means, len(players)):
            break
    estimate = total / max(count, 1)
    return {p: float(estimate[index[p]]) for p in players}, count


def random_orders(players: Sequence[int], rng: np.random.Generator) -> Iterable[list[int]]:
    """Uniform random permutations, without end (TMC-Shapley's sampling)."""
    while True:
        yield [players[k] for k in rng.permutation(len(players))]


def guided_orders(players: Sequence[int], rng: np.random.Generator) -> Iterable[list[int]]:
    """GTG's guided sampling (ii): sweeps in which each participant in turn is placed first
    and the others shuffled behind it."""
    while True:
        for first in players:
            rest = [p for p in players if p != first]
            yield [first, *(rest[k] for k in rng.permutation(len(rest)))]


def tmc_shapley(
    game: Game | CachedGame,
    players: Sequence[int],
    rng: np.random.Generator,
    *,
    tolerance: float = 1e-3,
    convergence: Convergence | None = None,
    orders: Iterable[Sequence[int]] | None = None,
) -> Valuation:
    """Truncated Monte-Carlo Shapley (Ghorbani & Zou, ICML 2019, Algorithm 1): the mean of the
    marginal contributions along random permutations, each walk truncated once the prefix is
    within ``tolerance`` of v(N); convergence (:class:`Convergence`) checked every n
    permutations, which are walked together. ``orders`` replaces the random permutations
    (all n! of them with tolerance 0 give the exact values)."""
    v = _as_cached(game)
    players = sorted(players)
    conv = (convergence or Convergence()) if orders is None else None
    source = orders if orders is not None else random_orders(players, rng)
    raw, count = _monte_carlo(v, players, source, tolerance, conv, len(players))
    return Valuation(raw, v.evaluations, count, gain=v(players) - v(()))


def rescale_to_gain(values: dict[int, float], gain: float) -> dict[int, float]:
    """GTG's normalization, step (v) (the authors' public code does this; it is not in the
    paper's pseudocode): gain >= 0 scales the values by gain / (sum
    of the non-negative values), gain < 0 by gain / (sum of the negative ones); so the sum
    is the gain only when all values share a sign. A zero denominator leaves the values."""
    pool = [x for x in values.values() if (x >= 0 if gain >= 0 else x < 0)]
    denominator = math.fsum(pool)
    if denominator == 0:
        return dict(values)
    return {p: gain * x / denominator for p, x in values.items()}


def gtg_shapley(
    game: Game | CachedGame,
    players: Sequence[int],
    rng: np.random.Generator,
    *,
    tolerance: float = 1e-3,
    round_tolerance: float = 1e-3,
    convergence: Convergence | None = None,
    orders: Iterable[Sequence[int]] | None = None,
) -> Valuation:
    """GTG-Shapley (Liu et al., ACM TIST 2022), steps (i)-(v): (i) a round whose gain
    |v(N) - v(0)| is at most ``round_tolerance`` values everyone 0; (ii) guided permutation
    sweeps; (iii) within-round truncation at ``tolerance``; (iv) the convergence rule of
    :class:`Convergence`, checked after each full sweep; (v) :func:`rescale_to_gain` (the raw
    estimate is kept beside it). ``orders`` replaces the guided sampling (tests)."""
    v = _as_cached(game)
    players = sorted(players)
    gain = v(players) - v(())
    if abs(gain) <= round_tolerance:
        zeros = {p: 0.0 for p in players}
        return Valuation(zeros, v.evaluations, 0, dict(zeros), truncated=True, gain=gain)
    conv = (convergence or Convergence()) if orders is None else None
    source = orders if orders is not None else guided_orders(players, rng)
    raw, count = _monte_carlo(v, players, source, tolerance, conv, len(players))
    return Valuation(raw, v.evaluations, count, rescale_to_gain(raw, gain), gain=gain)


ESTIMATORS = ("exact", "loo", "tmc", "gtg")


def estimate(
    kind: str,
    game: Game | CachedGame,
    players: Sequence[int],
    rng: np.random.Generator,
    tolerance: float = 1e-3,
    convergence: Convergence | None = None,
) -> Valuation:
    """The estimator ``kind`` (one of ``ESTIMATORS``) on ``game``."""
    if kind == "exact":
        return exact_shapley(game, players)
    if kind == "loo":
        return leave_one_out(game, players)
    if kind == "tmc":
        return tmc_shapley(game, players, rng, tolerance=tolerance, convergence=convergence)
    if kind == "gtg":
        return gtg_shapley(
            game,
            players,
            rng,
            tolerance=tolerance,
            round_tolerance=tolerance,
            convergence=convergence,
        )
    raise ValueError(f"no contribution estimator {kind!r}; choose one of {', '.join(ESTIMATORS)}")
