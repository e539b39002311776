"""Report panels of vertical and transfer runs (docs/vertical.md): loss and AUC (or RMSE) per
iteration or tree, bytes per party, and seconds in cryptography vs the rest. They read the run
directory only (``metrics.jsonl`` rows' ``vertical`` blocks, ``summary.json``)."""

from __future__ import annotations

import plotly.graph_objects as go

from fedloom.report.figures import (
    DOWN,
    GLOBAL,
    PERSONAL,
    TRAIN,
    UP,
    Panel,
    base_layout,
    no_rounds,
    right_axis,
    round_layout,
    round_line,
)
from fedloom.report.rundir import RunData, dig, latest, num


def is_vertical(run: RunData) -> bool:
    """A vertical partition in the config, or a ``vertical`` block in the summary."""
    kind = dig(run.config, "data", "partition", "kind")
    return kind == "vertical" or isinstance(dig(run.summary, "vertical"), dict)


def _unit(run: RunData) -> str:
    algo = dig(run.config, "algorithm", "name")
    return "tree" if algo == "secureboost" else "iteration"


def progress_panel(run: RunData) -> Panel:
    """Training loss and test loss; test AUC and accuracy (classification) or RMSE
    (regression) on the right axis."""
    unit = _unit(run)
    panel = Panel(
        "vertical_progress",
        f"Loss and test quality per {unit}",
        "The protocol's training loss (the Taylor loss of the linear models and FTL; SecureBoost: "
        "log loss or squared error of the training margins), the test loss, and test AUC and "
        "accuracy, or RMSE in the target's units.",
    )
    if not run.rounds:
        return no_rounds(panel)
    fig = go.Figure()
    for keys, name, color, dash in (
        (("train_loss",), "train loss", TRAIN, "dot"),
        (("global", "loss"), "test loss", GLOBAL, "solid"),
    ):
        ys = run.series(*keys)
        if any(v is not None for v in ys):
            fig.add_trace(round_line(run, ys, name, color, dash=dash))
    right = []
    for key, name, color in (
        ("auc", "test AUC", PERSONAL),
        ("accuracy", "test accuracy", UP),
        ("rmse", "test RMSE", PERSONAL),
    ):
        ys = run.series("global", key)
        if any(v is not None for v in ys):
            trace = round_line(run, ys, name, color)
            trace.yaxis = "y2"
            right.append(trace)
    for trace in right:
        fig.add_trace(trace)
    round_layout(fig, run, y_title="loss", height=420)
    fig.update_xaxes(title=f"{unit}s")
    if right:
        fig.update_layout(yaxis2=right_axis("RMSE" if right[0].name == "test RMSE" else "AUC"))
    panel.figure = fig
    return panel


def bytes_panel(run: RunData) -> Panel:
    """Training bytes each party sent and received."""
    panel = Panel(
        "vertical_bytes",
        "Bytes per party",
        "Training traffic each party sent and received over the whole run (ciphertexts, masked "
        "values, instance ids, openings of shares); the prediction used for evaluation is not "
        "included.",
        wide=False,
    )
    parties = dig(run.summary, "vertical", "bytes_by_party") or latest(
        run, "vertical", "bytes_by_party"
    )
    if not isinstance(parties, dict) or not parties:
        panel.note = "No per-party traffic was recorded."
        return panel
    names = list(parties)
    fig = go.Figure()
    for key, color in (("sent", UP), ("received", DOWN)):
        values = [num(dig(parties, p, key)) or 0.0 for p in names]
        fig.add_trace(
            go.Bar(x=names, y=values, name=key, marker_color=color, hovertemplate="%{y:,.0f} B")
        )
    base_layout(fig, height=380, x_title="party", y_title="bytes")
    fig.update_yaxes(tickformat="~s", ticksuffix="B")
    fig.update_layout(barmode="group")
    panel.figure = fig
    return panel


def seconds_panel(run: RunData) -> Panel:
    """Cumulative seconds in cryptography vs the rest of training."""
    unit = _unit(run)
    panel = Panel(
        "vertical_seconds",
        "Seconds in cryptography vs the rest",
        "Cumulative training time spent in encryption, homomorphic arithmetic, decryption and "
        "masking (or secret-sharing arithmetic), and in everything else.",
        wide=False,
    )
    if not run.rounds:
        return no_rounds(panel)
    crypto = run.series("vertical", "seconds_encryption")
    wall = run.series("wall_seconds")
    rest = [
        None if c is None or w is None else max(0.0, w - c)
        for c, w in zip(crypto, wall, strict=True)
    ]
    fig = go.Figure(
        [
            round_line(run, crypto, "cryptography", PERSONAL, hover="%{y:.3g} s"),
            round_line(run, rest, "everything else", TRAIN, hover="%{y:.3g} s"),
        ]
    )
    round_layout(fig, run, y_title="seconds (cumulative)")
    fig.update_xaxes(title=f"{unit}s")
    panel.figure = fig
    return panel


def build_panels(run: RunData) -> list[Panel]:
    return [progress_panel(run), bytes_panel(run), seconds_panel(run)]
