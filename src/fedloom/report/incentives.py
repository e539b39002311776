"""Report panels of contribution evaluation and incentives (docs/incentives.md): cumulative
payoff vs contribution per client for FLI and the baselines, the regret and waiting queues
per client over rounds, Jain's index per scheme over rounds, the cumulative contribution per
client, and the fairness metrics side by side. They read the run directory only (the
``contribution`` and ``incentive`` entries of ``metrics.jsonl`` rows and ``summary.json``)."""

from __future__ import annotations

from typing import Any

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from fedloom.report.figures import (
    CLIENT_COLORS,
    DOWN,
    GLOBAL,
    PERSONAL,
    TRAIN,
    UP,
    Panel,
    base_layout,
    no_rounds,
    round_layout,
    round_line,
)
from fedloom.report.rundir import RunData, dig, latest, num

SCHEME_COLORS = {
    "fli": PERSONAL,
    "equal": TRAIN,
    "samples": UP,
    "shapley": GLOBAL,
    "cost": DOWN,
}


def has_contribution(run: RunData) -> bool:
    return (
        isinstance(dig(run.summary, "contribution"), dict)
        or latest(run, "contribution", "cumulative") is not None
    )


def has_incentive(run: RunData) -> bool:
    return (
        isinstance(dig(run.summary, "incentive"), dict)
        or latest(run, "incentive", "cumulative") is not None
    )


def _clients(values: dict[str, Any]) -> list[str]:
    return sorted(values, key=lambda c: int(c) if c.lstrip("-").isdigit() else c)


def _contribution_totals(run: RunData) -> dict[str, float]:
    totals = dig(run.summary, "contribution", "per_client") or latest(
        run, "contribution", "cumulative"
    )
    return totals if isinstance(totals, dict) else {}


def payoff_vs_contribution_panel(run: RunData) -> Panel:
    """One point per client and scheme: its cumulative contribution against its cumulative
    payoff."""
    panel = Panel(
        "incentive_payoff",
        "Cumulative payoff vs contribution",
        "Each client's total payoff under FLI and each baseline (equal split, by sample count, "
        "Shapley-proportional, cost only; the same budget each round) against its cumulative "
        "contribution. A scheme that rewards contribution rises to the right.",
    )
    paid = latest(run, "incentive", "cumulative")
    contribution = _contribution_totals(run)
    if not isinstance(paid, dict) or not paid:
        return no_rounds(panel)
    fig = go.Figure()
    for scheme, payoff in paid.items():
        clients = _clients(payoff)
        x = [num(contribution.get(c)) for c in clients] if contribution else clients
        fig.add_trace(
            go.Scatter(
                x=x,
                y=[payoff[c] for c in clients],
                text=[f"client {c}" for c in clients],
                name=scheme,
                mode="markers",
                marker={"size": 10, "color": SCHEME_COLORS.get(scheme, TRAIN), "opacity": 0.85},
                hovertemplate="%{text}: payoff %{y:.4g}<extra>" + scheme + "</extra>",
            )
        )
    x_title = "cumulative contribution" if contribution else "client (no contribution measured)"
    base_layout(fig, height=420, x_title=x_title, y_title="cumulative payoff")
    panel.figure = fig
    return panel


def queues_panel(run: RunData) -> Panel:
    """The headline scheme's regret Y and waiting Q queues per client over rounds."""
    scheme = dig(run.summary, "incentive", "kind") or latest(run, "incentive", "kind")
    panel = Panel(
        "incentive_queues",
        "Regret and waiting queues per client",
        f"{scheme or 'The headline scheme'}'s regret queue Y (cost not yet paid back) and "
        "temporal queue Q (waiting) of each client at the evaluated rounds.",
    )
    if not run.rounds or not scheme:
        return no_rounds(panel)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("regret Y", "waiting Q"))
    last = latest(run, "incentive", "regret", scheme) or {}
    for k, client in enumerate(_clients(last)):
        color = CLIENT_COLORS[k % len(CLIENT_COLORS)]
        for col, key in ((1, "regret"), (2, "waiting")):
            trace = round_line(
                run, run.series("incentive", key, scheme, client), f"client {client}", color
            )
            trace.legendgroup, trace.showlegend = client, col == 1
            fig.add_trace(trace, row=1, col=col)
    round_layout(fig, run, y_title="queue")
    panel.figure = fig
    return panel


def jain_panel(run: RunData) -> Panel:
    """Jain's index of the cumulative payoff/cost ratio per scheme over rounds."""
    panel = Panel(
        "incentive_jain",
        "Jain's fairness index per scheme",
        "Jain's index (sum x)^2 / (n sum x^2) of the clients' cumulative payoff per unit of "
        "cost: 1 when every client is paid the same per unit of cost.",
        wide=False,
    )
    jain = latest(run, "incentive", "jain")
    if not run.rounds or not isinstance(jain, dict):
        return no_rounds(panel)
    fig = go.Figure(
        [
            round_line(run, run.series("incentive", "jain", s), s, SCHEME_COLORS.get(s, TRAIN))
            for s in jain
        ]
    )
    round_layout(fig, run, y_title="Jain's index")
    panel.figure = fig
    return panel


def contribution_panel(run: RunData) -> Panel:
    """Each client's cumulative contribution over rounds."""
    kind = dig(run.summary, "contribution", "kind") or dig(run.config, "contribution", "kind")
    panel = Panel(
        "contribution",
        "Cumulative contribution per client",
        f"The sum over valued rounds of each client's {kind or ''} value: its share of the "
        "validation metric's change that the round's uploads bring (docs/incentives.md).",
        wide=False,
    )
    last = latest(run, "contribution", "cumulative")
    if not run.rounds or not isinstance(last, dict):
        return no_rounds(panel)
    fig = go.Figure()
    for k, client in enumerate(_clients(last)):
        color = CLIENT_COLORS[k % len(CLIENT_COLORS)]
        fig.add_trace(
            round_line(
                run, run.series("contribution", "cumulative", client), f"client {client}", color
            )
        )
    round_layout(fig, run, y_title="cumulative contribution")
    panel.figure = fig
    return panel


FAIRNESS_ROWS = (
    ("total_payoff", "total payoff"),
    ("spearman_payoff_contribution", "Spearman(payoff, contribution)"),
    ("jain_payoff_per_cost", "Jain index of payoff/cost"),
    ("variance_payoff_per_cost", "variance of payoff/cost"),
    ("regret_mean", "mean regret Y"),
    ("regret_variance", "variance of regret Y"),
    ("waiting_mean", "mean waiting Q"),
    ("waiting_variance", "variance of waiting Q"),
)


def fairness_panel(run: RunData) -> Panel:
    """The summary's fairness metrics, one column per scheme."""
    panel = Panel(
        "incentive_fairness",
        "Fairness and quality metrics, FLI and baselines",
        "Over the whole run, per scheme (docs/incentives.md).",
    )
    schemes = dig(run.summary, "incentive", "schemes")
    if not isinstance(schemes, dict) or not schemes:
        panel.note = "The run has not finished: the metrics are in summary.json at the end."
        return panel

    def cell(value: Any) -> str:
        x = num(value)
        return "–" if x is None else f"{x:.4g}"

    names = list(schemes)
    fig = go.Figure(
        go.Table(
            header={"values": ["metric", *names], "align": "left"},
            cells={
                "values": [
                    [label for _, label in FAIRNESS_ROWS],
                    *[[cell(schemes[s].get(k)) for k, _ in FAIRNESS_ROWS] for s in names],
                ],
                "align": "left",
            },
        )
    )
    fig.update_layout(height=60 + 30 * len(FAIRNESS_ROWS), margin={"l": 8, "r": 8, "t": 8, "b": 8})
    panel.figure = fig
    return panel


def build_panels(run: RunData) -> list[Panel]:
    """The panels this run has data for (none without contribution or incentive)."""
    panels: list[Panel] = []
    if has_incentive(run):
        panels += [payoff_vs_contribution_panel(run), queues_panel(run), jain_panel(run)]
    if has_contribution(run):
        panels.append(contribution_panel(run))
    if has_incentive(run):
        panels.append(fairness_panel(run))
    return panels
