"""Plotly figures of a run: accuracy, loss, communication, per-client accuracy, labels."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import plotly.graph_objects as go

from fedloom.report.format import human_bytes
from fedloom.report.rundir import LabelHistogram, RunData, num

GLOBAL = "#1f5fa8"
PERSONAL = "#d1495b"
PERSONAL_BAND = "rgba(209, 73, 91, 0.16)"
NEW_CLIENTS = "#7b4fa8"
TRAIN = "#6c757d"
UP = "#2a9d8f"
DOWN = "#e9a23b"
CLIENT_COLORS = (GLOBAL, PERSONAL, UP, DOWN, NEW_CLIENTS, TRAIN, "#3d405b", "#81b29a")
"""Colours cycled over per-client lines (``CLIENT_COLORS[k % len(CLIENT_COLORS)]``)."""
FONT = "system-ui, -apple-system, 'Segoe UI', Roboto, Helvetica, Arial, sans-serif"
PERCENT = ".1~%"
MARKERS_UP_TO = 40  # draw point markers when there are at most this many rounds


@dataclass
class Panel:
    """One figure slot of the page: a figure, or a note saying why there is none."""

    key: str
    title: str
    caption: str
    figure: go.Figure | None = None
    note: str = ""
    wide: bool = True


def base_layout(
    fig: go.Figure,
    *,
    height: int,
    x_title: str,
    y_title: str,
    y_format: str | None = None,
    y2_title: str | None = None,
) -> go.Figure:
    """The page's common layout; ``y_format``: the y ticks' format (e.g. ``PERCENT``);
    ``y2_title``: add a second y axis on the right (``right_axis``)."""
    fig.update_layout(
        template="plotly_white",
        height=height,
        margin={"l": 64, "r": 24, "t": 64, "b": 52},
        font={"family": FONT, "size": 13, "color": "#1d2733"},
        legend={"orientation": "h", "yanchor": "bottom", "y": 1.02, "x": 0, "xanchor": "left"},
        hoverlabel={"font": {"family": FONT}},
        xaxis_title=x_title,
        yaxis_title=y_title,
    )
    return _y_axes(fig, y_format, y2_title)


def round_layout(
    fig: go.Figure,
    run: RunData,
    *,
    y_title: str,
    height: int = 400,
    y_format: str | None = None,
    y2_title: str | None = None,
) -> go.Figure:
    """``base_layout`` over rounds: unified hover, whole-round ticks."""
    base_layout(fig, height=height, x_title="round", y_title=y_title)
    fig.update_layout(hovermode="x unified")
    rounds = run.round_numbers
    if rounds and all(r.is_integer() for r in rounds):
        fig.update_xaxes(tickformat="d")
        if rounds[-1] - rounds[0] < 10:  # few rounds: avoid ticks at fractional rounds
            fig.update_xaxes(dtick=1, range=[rounds[0] - 0.5, rounds[-1] + 0.5])
    return _y_axes(fig, y_format, y2_title)


def _y_axes(fig: go.Figure, y_format: str | None, y2_title: str | None) -> go.Figure:
    if y_format is not None:
        fig.update_yaxes(tickformat=y_format)
    if y2_title is not None:
        fig.update_layout(yaxis2=right_axis(y2_title))
    return fig


def _mode(run: RunData) -> str:
    return "lines+markers" if len(run.rounds) <= MARKERS_UP_TO else "lines"


def round_line(
    run: RunData,
    y: list[float | None],
    name: str,
    color: str,
    *,
    dash: str = "solid",
    width: float = 2.4,
    hover: str = "%{y:.4g}",
) -> go.Scatter:
    return go.Scatter(
        x=run.round_numbers,
        y=y,
        name=name,
        mode=_mode(run),
        line={"color": color, "dash": dash, "width": width},
        marker={"size": 6},
        hovertemplate=hover + "<extra></extra>",
    )


def add_band(
    fig: go.Figure,
    run: RunData,
    low: list[float | None],
    high: list[float | None],
    name: str,
    fill: str,
) -> None:
    """A shaded band between two per-round series (one legend entry, no hover)."""
    band = {"x": run.round_numbers, "mode": "lines", "line": {"width": 0}, "hoverinfo": "skip"}
    fig.add_trace(go.Scatter(y=high, showlegend=False, legendgroup=name, **band))
    fig.add_trace(
        go.Scatter(y=low, fill="tonexty", fillcolor=fill, name=name, legendgroup=name, **band)
    )


def right_axis(title: str) -> dict:
    """Layout of a second y axis on the right, over the first (``yaxis2``)."""
    return {"title": title, "overlaying": "y", "side": "right", "showgrid": False}


def no_rounds(panel: Panel) -> Panel:
    panel.note = "No evaluated rounds yet."
    return panel


def _reported(series: list[float | None]) -> bool:
    return any(v is not None for v in series)


def _median_line(
    run: RunData,
    p10: list[float | None],
    p50: list[float | None],
    p90: list[float | None],
    has_band: bool,
) -> go.Scatter:
    """The personalized median, with P10 and P90 in its hover text where the band is shown,
    and as a whisker where there is only one round (a band needs two)."""
    pct = f"%{{y:{PERCENT}}}"
    median = round_line(run, p50, "personalized P50", PERSONAL, dash="dot", width=1.8, hover=pct)
    if has_band and len(run.rounds) == 1:
        lo, mid, hi = p10[0], p50[0], p90[0]
        if lo is not None and mid is not None and hi is not None:
            median.error_y = {
                "type": "data",
                "array": [hi - mid],
                "arrayminus": [mid - lo],
                "color": PERSONAL,
                "thickness": 1.5,
                "width": 8,
            }
    if has_band:
        median.customdata = list(zip(p10, p90, strict=True))
        median.hovertemplate = (
            f"{pct} (P10 %{{customdata[0]:{PERCENT}}}, P90 %{{customdata[1]:{PERCENT}}})"
            "<extra></extra>"
        )
    return median


def accuracy_panel(run: RunData) -> Panel:
    """Global accuracy, personalized mean, P10–P90 band and P50 per round."""
    panel = Panel(
        "accuracy",
        "Accuracy per round",
        "Global model on the pooled test data, and each client's personalized model on its "
        "own test data (mean, median and the band from the 10th to the 90th percentile).",
    )
    if not run.rounds:
        return no_rounds(panel)
    glob = run.series("global", "accuracy")
    mean = run.series("personalized", "accuracy_mean")
    p10 = run.series("personalized", "accuracy_p10")
    p50 = run.series("personalized", "accuracy_p50")
    p90 = run.series("personalized", "accuracy_p90")
    new = run.series("new_clients", "accuracy_mean")
    if not any(_reported(s) for s in (glob, mean, p10, p50, p90, new)):
        panel.note = "No accuracy was reported (a regression task?); see the loss figure."
        return panel
    pct = f"%{{y:{PERCENT}}}"
    fig = go.Figure()
    has_band = _reported(p10) and _reported(p90)
    if has_band:
        add_band(fig, run, p10, p90, "personalized P10–P90", PERSONAL_BAND)
    if _reported(p50):
        fig.add_trace(_median_line(run, p10, p50, p90, has_band))
    if _reported(mean):
        fig.add_trace(round_line(run, mean, "personalized mean", PERSONAL, hover=pct))
    if _reported(new):
        fig.add_trace(round_line(run, new, "new clients mean", NEW_CLIENTS, dash="dash", hover=pct))
    if _reported(glob):
        fig.add_trace(round_line(run, glob, "global", GLOBAL, width=2.8, hover=pct))
    else:
        panel.note = "No global model in this run: only personalized accuracy is shown."
    round_layout(fig, run, y_title="accuracy", height=430, y_format=PERCENT)
    panel.figure = fig
    return panel


def cold_start_panel(run: RunData) -> Panel:
    """Held-out new clients' accuracy vs fine-tuning steps (summary.json ``cold_start``)."""
    panel = Panel(
        "cold_start",
        "Cold start: new clients vs adaptation steps",
        "Clients held out of training (eval.new_clients), served the algorithm's way and then "
        "fine-tuned on their own data: mean accuracy and the P10–P90 range after each number "
        "of local steps.",
        wide=False,
    )
    curve = (run.summary or {}).get("cold_start")
    if not isinstance(curve, dict) or not curve.get("steps"):
        panel.note = "The cold-start evaluation runs when the run finishes."
        return panel
    steps = [num(s) for s in curve["steps"]]
    mean = [num(v) for v in curve.get("accuracy_mean") or []]
    if not any(v is not None for v in mean):
        panel.note = "No accuracy was reported for the new clients (a regression task?)."
        return panel
    p10 = [num(v) for v in curve.get("accuracy_p10") or []]
    p90 = [num(v) for v in curve.get("accuracy_p90") or []]
    pct = f"%{{y:{PERCENT}}}"
    fig = go.Figure()
    line = go.Scatter(
        x=steps,
        y=mean,
        name=f"mean over {curve.get('clients', '?')} new clients",
        mode="lines+markers",
        line={"color": NEW_CLIENTS, "width": 2.4},
        marker={"size": 8},
        hovertemplate=f"{pct} after %{{x}} steps<extra></extra>",
    )
    if len(p10) == len(mean) == len(p90) and None not in p10 + p90 + mean:
        line.error_y = {
            "type": "data",
            "array": [hi - m for hi, m in zip(p90, mean, strict=True)],
            "arrayminus": [m - lo for lo, m in zip(p10, mean, strict=True)],
            "color": NEW_CLIENTS,
            "thickness": 1.2,
            "width": 6,
        }
    fig.add_trace(line)
    base_layout(fig, height=400, x_title="adaptation steps", y_title="accuracy", y_format=PERCENT)
    fig.update_xaxes(tickvals=steps, type="linear")
    panel.figure = fig
    return panel


def loss_panel(run: RunData) -> Panel:
    """Global loss, personalized mean loss and training loss per round."""
    panel = Panel(
        "loss",
        "Loss per round",
        "Test loss of the global model and mean test loss of the personalized models; "
        "training loss is the clients' mean over the round's local steps.",
        wide=False,
    )
    if not run.rounds:
        return no_rounds(panel)
    lines = [
        (run.series("global", "loss"), "global", GLOBAL, "solid"),
        (run.series("personalized", "loss_mean"), "personalized", PERSONAL, "solid"),
        (run.series("new_clients", "loss_mean"), "new clients", NEW_CLIENTS, "dash"),
        (run.series("train_loss"), "train", TRAIN, "dot"),
    ]
    lines = [line for line in lines if any(v is not None for v in line[0])]
    if not lines:
        panel.note = "No loss was reported."
        return panel
    fig = go.Figure([round_line(run, y, name, color, dash=dash) for y, name, color, dash in lines])
    panel.figure = round_layout(fig, run, y_title="loss", height=380)
    return panel


def communication_panel(run: RunData) -> Panel:
    """Cumulative bytes uploaded and downloaded per round."""
    panel = Panel(
        "communication",
        "Cumulative communication",
        "Total bytes sent by clients to the server (up) and by the server to clients (down).",
        wide=False,
    )
    if not run.rounds:
        return no_rounds(panel)
    fig = go.Figure()
    lines = (("bytes_up", "up", UP, "solid"), ("bytes_down", "down", DOWN, "dash"))
    for key, name, color, dash in lines:
        ys = run.series("communication", key)
        if any(v is not None for v in ys):
            trace = round_line(run, ys, name, color, dash=dash, hover="%{customdata}")
            trace.customdata = ["—" if v is None else human_bytes(v) for v in ys]
            fig.add_trace(trace)
    if not fig.data:
        panel.note = "No communication was recorded."
        return panel
    round_layout(fig, run, y_title="bytes (cumulative)", height=380)
    fig.update_yaxes(tickformat="~s", ticksuffix="B", rangemode="tozero")
    panel.figure = fig
    return panel


def _last_client_accuracy(run: RunData) -> tuple[Any, list[Any]] | None:
    for row in reversed(run.rounds):
        values = row.get("client_accuracy")
        if isinstance(values, list) and values:
            return row["round"], values
    return None


def client_accuracy_panel(run: RunData) -> Panel:
    """Per-client personalized accuracy at the last evaluation that has it, sorted."""
    panel = Panel(
        "clients",
        "Personalized accuracy per client",
        "Each client's personalized model on its own test data at the last evaluation, "
        "sorted from worst to best.",
    )
    found = _last_client_accuracy(run)
    if found is None:
        panel.note = (
            "No per-client accuracy in metrics.jsonl." if run.rounds else "No evaluated rounds yet."
        )
        return panel
    round_no, values = found
    names = _client_names(run.label_histogram, len(values))
    pairs = [(num(v), name) for v, name in zip(values, names, strict=True)]
    scored = sorted(((v, n) for v, n in pairs if v is not None), key=lambda p: p[0])
    if not scored:
        panel.note = "Per-client accuracy is null (a regression task?)."
        return panel
    skipped = len(values) - len(scored)
    panel.caption += f" Round {_fmt_round(round_no)}, {len(scored)} clients."
    if skipped:
        panel.caption += f" {skipped} client(s) without a value are left out."
    accs = [v for v, _ in scored]
    fig = go.Figure(
        go.Bar(
            x=[n for _, n in scored],
            y=accs,
            marker={"color": PERSONAL, "opacity": 0.85, "line_width": 0},
            hovertemplate=f"%{{x}}: %{{y:{PERCENT}}}<extra></extra>",
            showlegend=False,
        )
    )
    mean = sum(accs) / len(accs)
    fig.add_hline(
        y=mean,
        line={"color": "#1d2733", "dash": "dash", "width": 1.5},
        annotation={"text": f"mean {mean:.1%}", "xanchor": "left", "x": 0.0},
        annotation_position="top left",
    )
    base_layout(fig, height=360, x_title="client (sorted by accuracy)", y_title="accuracy")
    fig.update_yaxes(tickformat=PERCENT, range=[0, 1.02])
    fig.update_xaxes(type="category", showticklabels=len(scored) <= 50, tickangle=-45)
    fig.update_layout(bargap=0.12 if len(scored) <= 100 else 0)
    panel.figure = fig
    return panel


def _client_names(histogram: LabelHistogram | None, n: int) -> list[str]:
    if histogram is not None and len(histogram.client_names) == n:
        names = histogram.client_names
        if len(set(names)) == n:
            return names
    return [f"client {i}" for i in range(n)]


def _fmt_round(value: Any) -> str:
    v = num(value)
    return str(int(v)) if v is not None and v.is_integer() else str(value)


def label_histogram_panel(histogram: LabelHistogram | None) -> Panel:
    """Heatmap of samples per class (columns) for each client (rows)."""
    panel = Panel(
        "labels",
        "Labels per client",
        "Number of training samples of each class held by each client: how non-IID the "
        "partition is.",
    )
    if histogram is None:
        panel.note = "No label histogram (label_histogram.json) in this run."
        return panel
    n_clients = len(histogram.counts)
    classes = [str(c) for c in range(histogram.num_classes)]
    totals = [sum(row) for row in histogram.counts]
    fig = go.Figure(
        go.Heatmap(
            z=histogram.counts,
            x=classes,
            y=histogram.client_names,
            customdata=[[total] * len(classes) for total in totals],
            colorscale="Blues",
            colorbar={"title": {"text": "samples"}, "thickness": 14},
            hovertemplate="%{y}, class %{x}: %{z:,.0f} of %{customdata:,.0f} samples"
            "<extra></extra>",
            xgap=1 if len(classes) <= 40 else 0,
            ygap=1 if n_clients <= 60 else 0,
        )
    )
    height = min(900, max(300, 110 + 16 * n_clients))
    base_layout(fig, height=height, x_title="class", y_title="client")
    fig.update_xaxes(type="category")
    fig.update_yaxes(type="category", autorange="reversed", showticklabels=n_clients <= 60)
    if n_clients <= 60:  # label every client, not every other one
        fig.update_yaxes(dtick=1, tickfont={"size": 11})
    panel.caption += f" {n_clients} clients × {len(classes)} classes, {sum(totals):,.0f} samples."
    panel.figure = fig
    return panel
