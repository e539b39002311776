"""The baselines FLI is compared with (equal split, by sample count, Shapley approximation,
cost only), as weights on the same budget B(t) (docs/incentives.md, "Incentives: FLI and the
baselines"). They
ignore the queues; :func:`fedloom.incentives.fli.pay_round` still keeps each baseline's
regret and waiting queues, so the fairness metrics compare like with like."""

from __future__ import annotations

from collections.abc import Mapping

from fedloom.incentives.fli import Ledger, RoundInput, Weights, fli_weights


def equal(
    round: RoundInput, ledger: Ledger, charged: Mapping[int, float], arrivals: Mapping[int, float]
) -> dict[int, float]:
    """Equal split among the participants with c_i > 0 (among all when none has a cost)."""
    costly = [i for i in round.participants if round.cost[i] > 0]
    chosen = set(costly or round.participants)
    return {i: 1.0 if i in chosen else 0.0 for i in round.participants}


def samples(
    round: RoundInput, ledger: Ledger, charged: Mapping[int, float], arrivals: Mapping[int, float]
) -> dict[int, float]:
    """By sample count: n_i / sum_j n_j."""
    return {i: float(round.samples[i]) for i in round.participants}


def shapley(
    round: RoundInput, ledger: Ledger, charged: Mapping[int, float], arrivals: Mapping[int, float]
) -> dict[int, float]:
    """Shapley-proportional: phi_i+ / sum_j phi_j+ (``round.contribution`` is clipped at 0
    already; all zero: nobody is paid that round)."""
    return {i: max(0.0, round.contribution[i]) for i in round.participants}


def cost(
    round: RoundInput, ledger: Ledger, charged: Mapping[int, float], arrivals: Mapping[int, float]
) -> dict[int, float]:
    """Cost only: c_i / sum_j c_j (the round's reported cost, in every sub-round)."""
    return {i: round.cost[i] for i in round.participants}


SCHEMES = ("fli", "equal", "samples", "shapley", "cost")
NEEDS_CONTRIBUTION = ("fli", "shapley")
"""The schemes that pay by contribution: they need ``contribution.kind`` other than none."""


def scheme_weights(name: str, omega: float) -> Weights:
    """The weights of scheme ``name`` (one of ``SCHEMES``)."""
    if name == "fli":
        return fli_weights(omega)
    table: dict[str, Weights] = {
        "equal": equal,
        "samples": samples,
        "shapley": shapley,
        "cost": cost,
    }
    if name not in table:
        raise ValueError(f"no incentive scheme {name!r}; choose one of {', '.join(SCHEMES)}")
    return table[name]
