"""FLI, the Federated Learning Incentivizer (Yu et al., AIES 2020, DOI 10.1145/3375627.3375840;
IEEE Intelligent Systems 2020, DOI 10.1109/MIS.2020.2987774); docs/incentives.md, "Incentives:
FLI and the baselines".

Per round t a budget B(t) is paid to the round's participants. Each participant i carries a
regret queue Y_i (cost not yet paid back) and a temporal ("waiting") queue Q_i::

    Y_i(t+1) = max(Y_i(t) + c_i(t) - u_i(t), 0)
    Q_i(t+1) = max(Q_i(t) + lambda_i(t) - u_i(t), 0)

Minimizing the Lyapunov drift of L = 1/2 sum_i (Y_i^2 + Q_i^2) minus omega sum_i q_i u_i gives,
per i, u_i* = 1/2 (omega q_i + Y_i + c_i + Q_i + lambda_i), scaled to the budget:
u_i = B u_i* / sum_j u_j*. B(t) is paid in R equal sub-budgets, Y and Q updated after each,
the contribution fixed within the round and the cost charged in the first sub-round only
(the authors' public game code).

Each formula whose match to the papers is uncertain (the rules were reconstructed from the
papers' abstracts and the authors' game code, docs/incentives.md) is one small function below,
its confidence in its docstring, so that a correction is one line: :func:`waiting_arrival`
(lambda rule, medium), :func:`contribution_signal` (how q is measured, medium),
:func:`round_budget` (the budget function, low). The queue recursions and the closed form
(:func:`fli_weight`, :func:`scale_to_budget`) are high confidence.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


def fli_weight(
    contribution: float, regret: float, cost: float, waiting: float, arrival: float, omega: float
) -> float:
    """u_i* = 1/2 (omega q_i + Y_i + c_i + Q_i + lambda_i): the minimizer of
    1/2 (c-u)^2 + Y (c-u) + 1/2 (lambda-u)^2 + Q (lambda-u) - omega q u (high
    confidence: the derivation and the authors' game code agree)."""
    return 0.5 * (omega * contribution + regret + cost + waiting + arrival)


def scale_to_budget(weights: Mapping[int, float], budget: float) -> dict[int, float]:
    """u_i = B w_i / sum_j w_j (all zero: nobody is paid). High confidence."""
    total = math.fsum(weights.values())
    if total <= 0:
        return {i: 0.0 for i in weights}
    return {i: budget * w / total for i, w in weights.items()}


def waiting_arrival(regret: float, mean_cost: float, sub_rounds: int) -> float:
    """lambda_i(t): the temporal queue's arrival. The game code's rule: the mean of i's
    reported costs so far (this round's included) over R while i is owed (Y_i > 0), else 0.
    Confidence: medium (the game code's rule; the papers' text was not checked)."""
    return mean_cost / sub_rounds if regret > 0 else 0.0


def contribution_signal(value: float) -> float:
    """q_i(t) >= 0 from a contribution estimate (Shapley value, GTG's rescaled value or
    leave-one-out): negative values clipped to 0, as the game code's max(0, B(N) - B(N - i)).
    Confidence: medium (how the papers measure q was not checked)."""
    return max(0.0, value)


def round_budget(budget: float, round: int) -> float:
    """B(t): the same ``incentive.budget`` every round. The game code instead derives it
    from revenue, B0 log(1 + sum of model qualities); confidence: low."""
    return budget


@dataclass
class RoundInput:
    """What a round's payments depend on, per participant: its reported cost c_i(t), its
    contribution q_i(t) (already :func:`contribution_signal`-ed), its training samples (the
    by-sample baseline) and the mean of its reported costs so far (lambda rule)."""

    participants: list[int]
    cost: dict[int, float]
    contribution: dict[int, float]
    samples: dict[int, float]
    mean_cost: dict[int, float]


@dataclass
class Ledger:
    """One payment scheme's accounts: each client's regret Y, waiting Q and total pay."""

    regret: dict[int, float] = field(default_factory=dict)
    waiting: dict[int, float] = field(default_factory=dict)
    paid: dict[int, float] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        """JSON-safe (string client ids); floats round-trip exactly."""
        return {
            name: {str(k): v for k, v in getattr(self, name).items()}
            for name in ("regret", "waiting", "paid")
        }

    @classmethod
    def from_state_dict(cls, saved: Mapping[str, Mapping[str, float]]) -> Ledger:
        return cls(**{name: {int(k): float(v) for k, v in saved[name].items()} for name in saved})


Weights = Callable[[RoundInput, Ledger, Mapping[int, float], Mapping[int, float]], dict[int, float]]
"""(round, ledger, cost charged this sub-round, arrivals lambda) -> each participant's weight:
how a scheme splits a (sub-)budget."""


def fli_weights(omega: float) -> Weights:
    """FLI's scheme: :func:`fli_weight` of each participant from its queues."""

    def weights(
        round: RoundInput,
        ledger: Ledger,
        charged: Mapping[int, float],
        arrivals: Mapping[int, float],
    ) -> dict[int, float]:
        return {
            i: fli_weight(
                round.contribution[i],
                ledger.regret.get(i, 0.0),
                charged[i],
                ledger.waiting.get(i, 0.0),
                arrivals[i],
                omega,
            )
            for i in round.participants
        }

    return weights


def pay_round(
    ledger: Ledger,
    weights: Weights,
    round: RoundInput,
    budget: float,
    sub_rounds: int,
) -> dict[int, float]:
    """Pay ``budget`` to ``round.participants`` in ``sub_rounds`` equal parts, each split by
    ``weights`` and followed by the queue updates (cost charged in the first part only);
    returns the round's pay per participant (it sums to ``budget`` unless every weight is 0).
    The ledger moves to the end of the round."""
    pay = dict.fromkeys(round.participants, 0.0)
    part = budget / sub_rounds
    for r in range(sub_rounds):
        charged = {i: round.cost[i] if r == 0 else 0.0 for i in round.participants}
        arrivals = {
            i: waiting_arrival(ledger.regret.get(i, 0.0), round.mean_cost[i], sub_rounds)
            for i in round.participants
        }
        u = scale_to_budget(weights(round, ledger, charged, arrivals), part)
        for i in round.participants:
            y, q = ledger.regret.get(i, 0.0), ledger.waiting.get(i, 0.0)
            ledger.regret[i] = max(y + charged[i] - u[i], 0.0)
            ledger.waiting[i] = max(q + arrivals[i] - u[i], 0.0)
            pay[i] += u[i]
    for i, amount in pay.items():
        ledger.paid[i] = ledger.paid.get(i, 0.0) + amount
    return pay
