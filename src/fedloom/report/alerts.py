"""The alert rules of the monitoring table (docs/monitoring.md, "Alerts"), evaluated on a run's
files: each alert names its rule, the round it fired and what was seen.

| rule | fires when (thresholds: config ``monitor.alerts``) |
| --- | --- |
| loss_plateau | the loss (global, else training) has no new minimum for ``loss_patience`` evaluations in a row (default: no decrease for 5 evaluations) |
| update_norm_exploding | the median client update norm exceeds ``update_norm_growth`` x its first value, or is not finite (exploding gradients) |
| update_norm_vanishing | the median client update norm falls below ``update_norm_decay`` x its first value (vanishing gradients) |
| client_update_norm_exploding | a client's update norm exceeds ``update_norm_growth_client`` x its own first recorded value, or is not finite (one client diverging) |
| client_accuracy_collapse | a client with at least ``client_accuracy_min_samples`` test samples (default 20) has its personalized accuracy fall below ``client_accuracy_drop`` x its best earlier value (e.g. to near 0) |
| nonfinite_dropped | clients whose loss or model was not finite were left out of rounds (``train.nonfinite: drop``) |
| p10_low | the latest personalized accuracy P10 is below ``p10_min`` (P10 < 0.65) |
| zeta_jump | zeta^2 rises by more than ``zeta_jump`` (2.0 = 200%) between two evaluations (a zeta^2 jump > 200%) |
| communication_budget | cumulative bytes up + down exceed ``communication_budget_mb`` (communication over budget) |
| cold_start_slow | new clients do not reach ``cold_start_target`` x the trained clients' mean accuracy within ``cold_start_steps`` adaptation steps (cold start > 20 steps) |
| privacy_budget | a privacy mechanism's epsilon exceeds ``epsilon_max`` (epsilon > 10) |
| secure_aggregation_aborted | secure aggregation rounds aborted (too few clients survived for the protocol's threshold; those rounds left the model unchanged) |
"""  # noqa: E501

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from fedloom.report.rundir import RunData, dig, num
from fedloom.run_config.monitor import AlertConfig

MB = 1e6


@dataclass(frozen=True)
class Alert:
    rule: str
    round: float | None
    message: str


def thresholds(run: RunData) -> AlertConfig:
    """The run's ``monitor.alerts`` (defaults where missing or invalid)."""
    raw = dig(run.config, "monitor", "alerts")
    try:
        return AlertConfig.model_validate(raw if isinstance(raw, dict) else {})
    except ValidationError:
        return AlertConfig()


def evaluate_alerts(run: RunData) -> list[Alert]:
    """Every alert the run's metrics and summary trigger, in round order."""
    cfg = thresholds(run)
    alerts = [
        *loss_plateau(run, cfg.loss_patience),
        *update_norm_alerts(run, cfg.update_norm_growth, cfg.update_norm_decay),
        *client_update_norm_exploding(run, cfg.update_norm_growth_client),
        *client_accuracy_collapse(run, cfg.client_accuracy_drop, cfg.client_accuracy_min_samples),
        *nonfinite_dropped(run),
        *p10_low(run, cfg.p10_min),
        *zeta_jump(run, cfg.zeta_jump),
        *communication_budget(run, cfg.communication_budget_mb),
        *cold_start_slow(run, cfg.cold_start_steps, cfg.cold_start_target),
        *privacy_budget(run, cfg.epsilon_max),
        *secure_aggregation_aborted(run),
    ]
    return sorted(alerts, key=lambda a: (math.inf if a.round is None else a.round, a.rule))


def _points(run: RunData, *keys: str) -> list[tuple[float, float]]:
    return [
        (r, v) for r, v in zip(run.round_numbers, run.series(*keys), strict=True) if v is not None
    ]


def loss_plateau(run: RunData, patience: int) -> list[Alert]:
    points = _points(run, "global", "loss") or _points(run, "train_loss")
    alerts, best, since = [], math.inf, 0
    for rnd, loss in points:
        if loss < best:
            best, since = loss, 0
            continue
        since += 1
        if since == patience:
            alerts.append(
                Alert(
                    "loss_plateau",
                    rnd,
                    f"loss has not improved on its minimum {best:.4g} for {patience} evaluations",
                )
            )
    return alerts


def update_norm_alerts(run: RunData, growth: float, decay: float) -> list[Alert]:
    medians = [
        (r, dig(row, "monitor", "update_norm", "p50"))
        for r, row in zip(run.round_numbers, run.rounds, strict=True)
    ]
    medians = [(r, m) for r, m in medians if isinstance(m, int | float)]
    if not medians:
        return []
    first = next((m for _, m in medians if math.isfinite(m) and m > 0), None)
    for rnd, m in medians:
        if not math.isfinite(m) or (first is not None and m > growth * first):
            return [
                Alert(
                    "update_norm_exploding",
                    rnd,
                    f"median update norm {m:.4g} vs {first:.4g} at the first evaluation",
                )
            ]
        if first is not None and m < decay * first:
            return [
                Alert(
                    "update_norm_vanishing",
                    rnd,
                    f"median update norm {m:.3g} vs {first:.4g} at the first evaluation",
                )
            ]
    return []


def _clients(found: list[str]) -> str:
    shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
    return f"client{'s' if len(found) > 1 else ''} {shown}"


def client_update_norm_exploding(run: RunData, growth: float) -> list[Alert]:
    """Per client (``monitor.client_update_norm``): its norm vs its own first finite one; one
    alert per evaluation in which some client first crosses, naming those clients."""
    first: dict[str, float] = {}
    fired: set[str] = set()
    alerts = []
    for rnd, row in zip(run.round_numbers, run.rounds, strict=True):
        norms = dig(row, "monitor", "client_update_norm")
        if not isinstance(norms, dict):
            continue
        found = []
        for client, value in norms.items():
            if client in fired or not isinstance(value, int | float):
                continue
            value = float(value)
            start = first.get(client)
            if not math.isfinite(value) or (start is not None and value > growth * start):
                was = f"{start:.3g}" if start is not None else "none finite before"
                found.append(f"{client} ({value:.3g}, first {was})")
                fired.add(client)
            elif start is None and value > 0:
                first[client] = value
        if found:
            alerts.append(
                Alert(
                    "client_update_norm_exploding",
                    rnd,
                    f"{_clients(found)}: update norm over {growth:g}x its first value or not "
                    "finite (diverging; lower train.lr, the local work or the algorithm's "
                    "coefficient)",
                )
            )
    return alerts


def client_names(run: RunData, count: int) -> list[str]:
    """The ids of the ``client_accuracy`` entries (summary's final client_accuracy keys when
    they match, else positions)."""
    ids = dig(run.summary, "final", "client_accuracy")
    if isinstance(ids, dict) and len(ids) == count:
        return [str(c) for c in ids]
    return [str(i) for i in range(count)]


def test_sizes(run: RunData) -> dict[str, int] | None:
    """Each client's number of test samples (heterogeneity.json's ``test_samples``), or None
    when the run did not record them (``monitor.enabled: false``, or an older run)."""
    sizes = dig(run.heterogeneity, "test_samples")
    if not isinstance(sizes, dict):
        return None
    return {str(c): int(n) for c, n in sizes.items() if num(n) is not None}


def client_accuracy_collapse(run: RunData, drop: float | None, min_samples: int) -> list[Alert]:
    """A client's personalized accuracy under ``drop`` x its best earlier evaluation (once per
    client; one alert per evaluation, naming the clients). Only clients with at least
    ``min_samples`` test samples are checked: on 5, one sample is 20 points, and a fine-tuned
    model's swing from 4/5 to 1/5 is no collapse. A run that did not record the sizes has every
    client checked, and its alerts say so."""
    if drop is None:
        return []
    sizes = test_sizes(run)
    checked = (
        f"clients with at least {min_samples} test samples checked"
        if sizes is not None
        else "test-set sizes not recorded (monitor.enabled: false): every client checked"
    )
    best: dict[int, float] = {}
    fired: set[int] = set()
    alerts = []
    for rnd, row in zip(run.round_numbers, run.rounds, strict=True):
        accuracy = row.get("client_accuracy") if isinstance(row, dict) else None
        if not isinstance(accuracy, list):
            continue
        names = client_names(run, len(accuracy))
        found = []
        for i, value in enumerate(accuracy):
            acc = num(value)
            if acc is None or i in fired:
                continue
            if sizes is not None and sizes.get(names[i], 0) < min_samples:
                continue
            top = best.get(i)
            if top is not None and top > 0 and acc < drop * top:
                found.append(f"{names[i]} ({acc:.1%}, best {top:.1%})")
                fired.add(i)
            best[i] = max(acc, top or 0.0)
        if found:
            alerts.append(
                Alert(
                    "client_accuracy_collapse",
                    rnd,
                    f"{_clients(found)}: personalized accuracy below {drop:.0%} of its best "
                    f"earlier value ({checked})",
                )
            )
    return alerts


def nonfinite_dropped(run: RunData) -> list[Alert]:
    """At the first evaluation that counts clients dropped as non-finite, with the run's
    total."""
    points = [(r, c) for r, c in _points(run, "dropped_nonfinite") if c > 0]
    if not points:
        return []
    total = max(c for _, c in points)
    return [
        Alert(
            "nonfinite_dropped",
            points[0][0],
            f"{total:.0f} client update(s) with a non-finite loss or model left out by round "
            f"{points[-1][0]:.0f} (train.nonfinite: drop; lower train.lr, the local work or the "
            "algorithm's coefficient)",
        )
    ]


def p10_low(run: RunData, minimum: float | None) -> list[Alert]:
    points = _points(run, "personalized", "accuracy_p10")
    if minimum is None or not points:
        return []
    rnd, p10 = points[-1]
    if p10 >= minimum:
        return []
    return [Alert("p10_low", rnd, f"personalized accuracy P10 {p10:.1%} < {minimum:.0%}")]


def zeta_jump(run: RunData, jump: float) -> list[Alert]:
    points = _points(run, "monitor", "zeta2")
    return [
        Alert("zeta_jump", rnd, f"zeta^2 rose from {prev:.4g} to {cur:.4g}")
        for (_, prev), (rnd, cur) in itertools.pairwise(points)
        if prev > 0 and cur > (1.0 + jump) * prev
    ]


def communication_budget(run: RunData, budget_mb: float | None) -> list[Alert]:
    if budget_mb is None:
        return []
    up = run.series("communication", "bytes_up")
    down = run.series("communication", "bytes_down")
    for rnd, u, d in zip(run.round_numbers, up, down, strict=True):
        if u is not None and d is not None and (u + d) / MB > budget_mb:
            return [
                Alert(
                    "communication_budget",
                    rnd,
                    f"{(u + d) / MB:,.1f} MB sent and received, over the {budget_mb:g} MB budget",
                )
            ]
    return []


def cold_start_slow(run: RunData, max_steps: int, target: float) -> list[Alert]:
    curve: Any = (run.summary or {}).get("cold_start")
    trained = num(dig(run.summary, "final", "personalized", "accuracy_mean"))
    if not isinstance(curve, dict) or trained is None:
        return []
    goal = target * trained
    steps = [num(s) for s in curve.get("steps") or []]
    accuracy = [num(a) for a in curve.get("accuracy_mean") or []]
    reached = [
        s
        for s, a in zip(steps, accuracy, strict=False)
        if s is not None and a is not None and a >= goal
    ]
    if reached and min(reached) <= max_steps:
        return []
    last = run.round_numbers[-1] if run.rounds else None
    best = max((a for a in accuracy if a is not None), default=None)
    seen = f"best {best:.1%}" if best is not None else "no accuracy"
    return [
        Alert(
            "cold_start_slow",
            last,
            f"new clients reach {seen}, not {goal:.1%} ({target:.0%} of the trained clients' "
            f"{trained:.1%}) within {max_steps} steps",
        )
    ]


def privacy_budget(run: RunData, epsilon_max: float) -> list[Alert]:
    for rnd, eps in _points(run, "privacy", "epsilon"):
        if eps > epsilon_max:
            return [Alert("privacy_budget", rnd, f"epsilon {eps:.3g} > {epsilon_max:g}")]
    return []


def secure_aggregation_aborted(run: RunData) -> list[Alert]:
    for rnd, aborted in _points(run, "secure_aggregation", "rounds_aborted"):
        if aborted > 0:
            last = dig(run.rounds[-1], "secure_aggregation", "rounds_aborted") or aborted
            return [
                Alert(
                    "secure_aggregation_aborted",
                    rnd,
                    f"{int(last)} secure aggregation round(s) aborted: too few clients survived "
                    "the protocol's threshold (lower train.dropout or the threshold)",
                )
            ]
    return []
