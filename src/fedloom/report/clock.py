"""The virtual clock's figure (docs/asynchrony.md): accuracy against virtual time, for runs
whose metrics rows carry ``clock`` (``asynchrony.kind`` fedasync or fedbuff, or a synchronous
run with ``asynchrony.speeds``), so that synchronous and asynchronous runs compare by time."""

from __future__ import annotations

import plotly.graph_objects as go

from fedloom.report.figures import GLOBAL, PERCENT, PERSONAL, Panel, base_layout
from fedloom.report.rundir import RunData, dig


def has_clock(run: RunData) -> bool:
    return any(v is not None for v in run.series("clock"))


def clock_panel(run: RunData) -> Panel:
    """Global accuracy and the personalized mean against the virtual clock."""
    kind = dig(run.config, "asynchrony", "kind") or "none"
    panel = Panel(
        "clock",
        "Accuracy against virtual time",
        "Each evaluated server step at its virtual time (one unit: one local step of a client "
        f"of speed 1; aggregation: {'synchronous' if kind == 'none' else kind}). A "
        "synchronous round lasts as long as its slowest client.",
    )
    clock = run.series("clock")
    fig = go.Figure()
    pct = f"%{{y:{PERCENT}}} at t = %{{x:.4g}} (round %{{customdata}})"
    for keys, name, color in (
        (("global", "accuracy"), "global", GLOBAL),
        (("personalized", "accuracy_mean"), "personalized mean", PERSONAL),
    ):
        ys = run.series(*keys)
        points = [
            (t, y, r)
            for t, y, r in zip(clock, ys, run.round_numbers, strict=True)
            if t is not None and y is not None
        ]
        if points:
            t, y, r = zip(*points, strict=True)
            fig.add_trace(
                go.Scatter(
                    x=list(t),
                    y=list(y),
                    customdata=[int(v) for v in r],
                    name=name,
                    mode="lines+markers" if len(points) <= 40 else "lines",
                    line={"color": color, "width": 2.4},
                    hovertemplate=pct + "<extra></extra>",
                )
            )
    if not fig.data:
        panel.note = "No accuracy was recorded with the clock."
        return panel
    base_layout(fig, height=400, x_title="virtual time", y_title="accuracy", y_format=PERCENT)
    panel.figure = fig
    return panel
