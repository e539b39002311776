"""A run's payments: FLI and its baselines side by side on the same budget B(t) each
round, one :class:`~fedloom.incentives.fli.Ledger` per scheme, and the fairness metrics of
each (docs/incentives.md). Pure bookkeeping: the engine (engine/contribution.py) feeds it each
round's participants, costs, contributions and sample counts, and checkpoints its state."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from fedloom.incentives.baselines import scheme_weights
from fedloom.incentives.fairness import fairness
from fedloom.incentives.fli import (
    Ledger,
    RoundInput,
    contribution_signal,
    pay_round,
    round_budget,
)


class IncentiveBook:
    """Payments of ``schemes`` (the first is the headline ``incentive.kind``)."""

    def __init__(
        self, schemes: Sequence[str], budget: float, omega: float, sub_rounds: int
    ) -> None:
        self.schemes = list(schemes)
        self.budget, self.omega, self.sub_rounds = budget, omega, sub_rounds
        self.ledgers = {s: Ledger() for s in self.schemes}
        self.cost: dict[int, float] = {}
        """Each client's total reported cost."""
        self.rounds: dict[int, int] = {}
        """Rounds each client took part in (the lambda rule's mean cost: cost / rounds)."""
        self.contribution: dict[int, float] = {}
        """Each client's total contribution signal q (what the schemes were paid by)."""

    def pay(
        self,
        round: int,
        cost: Mapping[int, float],
        contribution: Mapping[int, float] | None,
        samples: Mapping[int, float],
    ) -> dict[str, dict[int, float]]:
        """One round: every scheme pays B(t) to the participants (the keys of ``cost``);
        returns each scheme's pay per participant."""
        participants = sorted(cost)
        for i in participants:
            self.cost[i] = self.cost.get(i, 0.0) + cost[i]
            self.rounds[i] = self.rounds.get(i, 0) + 1
        signal = {i: contribution_signal((contribution or {}).get(i, 0.0)) for i in participants}
        if contribution is not None:
            for i in participants:
                self.contribution[i] = self.contribution.get(i, 0.0) + signal[i]
        inputs = RoundInput(
            participants,
            {i: float(cost[i]) for i in participants},
            signal,
            {i: float(samples[i]) for i in participants},
            {i: self.cost[i] / self.rounds[i] for i in participants},
        )
        budget = round_budget(self.budget, round)
        return {
            s: pay_round(
                self.ledgers[s], scheme_weights(s, self.omega), inputs, budget, self.sub_rounds
            )
            for s in self.schemes
        }

    def fairness(self, scheme: str) -> dict[str, Any]:
        ledger = self.ledgers[scheme]
        return fairness(ledger.paid, self.cost, self.contribution, ledger.regret, ledger.waiting)

    def summary(self) -> dict[str, Any]:
        """summary.json's ``incentive`` body: per client the headline scheme's total pay,
        cost and contribution; per scheme its pay per client and its fairness metrics."""
        head = self.schemes[0]
        paid = self.ledgers[head].paid
        return {
            "per_client": {
                str(i): {
                    "payoff": paid.get(i, 0.0),
                    "cost": self.cost[i],
                    "contribution": self.contribution.get(i),
                    "regret": self.ledgers[head].regret.get(i, 0.0),
                    "waiting": self.ledgers[head].waiting.get(i, 0.0),
                }
                for i in sorted(self.cost)
            },
            **self.fairness(head),
            "total_cost": math.fsum(self.cost.values()),
            "schemes": {
                s: {
                    "payoff": {str(i): v for i, v in sorted(self.ledgers[s].paid.items())},
                    **self.fairness(s),
                }
                for s in self.schemes
            },
        }

    def state_dict(self) -> dict[str, Any]:
        return {
            "ledgers": {s: ledger.state_dict() for s, ledger in self.ledgers.items()},
            "cost": {str(i): v for i, v in self.cost.items()},
            "rounds": {str(i): v for i, v in self.rounds.items()},
            "contribution": {str(i): v for i, v in self.contribution.items()},
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        self.ledgers = {s: Ledger.from_state_dict(saved["ledgers"][s]) for s in self.schemes}
        self.cost = {int(i): float(v) for i, v in saved["cost"].items()}
        self.rounds = {int(i): int(v) for i, v in saved["rounds"].items()}
        self.contribution = {int(i): float(v) for i, v in saved["contribution"].items()}
