"""Summaries of per-client evaluation: mean and P10/P50/P90/min of personalized accuracy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class EvalCounts:
    """Summed loss, correct predictions and sample count of one model on one test set."""

    loss_sum: float
    correct: float
    n: int

    @property
    def loss(self) -> float | None:
        return self.loss_sum / self.n if self.n else None

    @property
    def accuracy(self) -> float:
        return self.correct / self.n if self.n else float("nan")


def pooled(counts: list[EvalCounts], classification: bool) -> dict[str, float | None]:
    """Metrics of one model over the union of the test sets."""
    n = sum(c.n for c in counts)
    loss = sum(c.loss_sum for c in counts) / n if n else None
    acc = sum(c.correct for c in counts) / n if n and classification else None
    return {"accuracy": acc, "loss": loss}


def client_quantiles(counts: list[EvalCounts], classification: bool) -> dict[str, float | None]:
    """Unweighted mean and quantiles over clients of each client's own test accuracy."""
    evaluated = [c for c in counts if c.n > 0]
    losses = np.array([c.loss for c in evaluated], dtype=float)
    out: dict[str, float | None] = {"loss_mean": float(losses.mean()) if len(losses) else None}
    if classification and evaluated:
        acc = np.array([c.accuracy for c in evaluated], dtype=float)
        out |= {
            "accuracy_mean": float(acc.mean()),
            "accuracy_p10": float(np.percentile(acc, 10)),
            "accuracy_p50": float(np.percentile(acc, 50)),
            "accuracy_p90": float(np.percentile(acc, 90)),
            "accuracy_min": float(acc.min()),
        }
    else:
        out |= dict.fromkeys(
            ["accuracy_mean", "accuracy_p10", "accuracy_p50", "accuracy_p90", "accuracy_min"]
        )
    return out
