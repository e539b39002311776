"""The training-health panels of the report (docs/monitoring.md, "The report"): update norms,
the cosine-similarity heatmap of client updates, heterogeneity, resources."""

from __future__ import annotations

import plotly.graph_objects as go

from fedloom.report.figures import (
    DOWN,
    GLOBAL,
    NEW_CLIENTS,
    PERSONAL,
    TRAIN,
    UP,
    Panel,
    add_band,
    base_layout,
    no_rounds,
    round_layout,
    round_line,
)
from fedloom.report.rundir import RunData, dig, num

NORM = "#2a6f97"
NORM_BAND = "rgba(42, 111, 151, 0.16)"
MONITOR_OFF = "No monitoring records in this run (monitor.enabled: false, or an older run)."


def update_norm_panel(run: RunData) -> Panel:
    panel = Panel(
        "update_norms",
        "Client update norms",
        "||Δ_k|| of the reporting clients' round updates in each evaluated round: median, "
        "the P10–P90 band and the largest. Explosion or collapse shows here first.",
    )
    if not run.rounds:
        return no_rounds(panel)
    p10 = run.series("monitor", "update_norm", "p10")
    p50 = run.series("monitor", "update_norm", "p50")
    p90 = run.series("monitor", "update_norm", "p90")
    top = run.series("monitor", "update_norm", "max")
    if not any(v is not None for v in p50):
        panel.note = MONITOR_OFF
        return panel
    fig = go.Figure()
    add_band(fig, run, p10, p90, "P10–P90", NORM_BAND)
    fig.add_trace(round_line(run, p50, "median", NORM))
    fig.add_trace(round_line(run, top, "max", NORM, dash="dot", width=1.6))
    round_layout(fig, run, y_title="||Δ_k||")
    fig.update_yaxes(type="log")
    panel.figure = fig
    return panel


def cosine_panel(run: RunData) -> Panel:
    panel = Panel(
        "cosine",
        "Cosine similarity of client updates",
        "cos(Δ_i, Δ_j) between the reporting clients' updates of the last evaluated round: "
        "blocks of agreement reveal client clusters, negative cells conflicting objectives.",
        wide=False,
    )
    records = [(row.get("round"), dig(row, "monitor", "cosine")) for row in run.rounds if row]
    records = [(r, c) for r, c in records if isinstance(c, dict) and c.get("matrix")]
    if not records:
        panel.note = MONITOR_OFF if run.rounds else "No evaluated rounds yet."
        return panel
    rnd, cosine = records[-1]
    labels = [f"client {c}" for c in cosine.get("clients", [])]
    matrix = [[num(v) for v in row] for row in cosine["matrix"]]
    fig = go.Figure(
        go.Heatmap(
            z=matrix,
            x=labels,
            y=labels,
            zmin=-1,
            zmax=1,
            colorscale="RdBu",
            reversescale=False,
            colorbar={"title": "cos"},
            hovertemplate="%{y} · %{x}: %{z:.3f}<extra></extra>",
        )
    )
    base_layout(fig, height=430, x_title="", y_title="")
    fig.update_layout(title={"text": f"round {rnd}", "x": 0.01, "font": {"size": 13}})
    fig.update_yaxes(autorange="reversed")
    panel.figure = fig
    return panel


def heterogeneity_panel(run: RunData) -> Panel:
    panel = Panel(
        "heterogeneity",
        "Gradient dissimilarity ζ²",
        "ζ² = 1/K Σ_k ||∇F_k(w) − ∇F(w)||² at the global model, on a fixed sample of clients "
        "(docs/monitoring.md): how far the clients' objectives pull apart as training goes.",
        wide=False,
    )
    if not run.rounds:
        return no_rounds(panel)
    zeta = run.series("monitor", "zeta2")
    if not any(v is not None for v in zeta):
        panel.note = (
            "No ζ²: the algorithm has no global model to measure it at."
            if any(dig(row, "monitor") for row in run.rounds)
            else MONITOR_OFF
        )
        return panel
    fig = go.Figure(round_line(run, zeta, "ζ²", GLOBAL))
    panel.figure = round_layout(fig, run, y_title="ζ²")
    return panel


def client_heterogeneity_panel(run: RunData) -> Panel:
    panel = Panel(
        "client_heterogeneity",
        "Each client's data vs the pooled data",
        "Label-distribution KL(P_k || P) (nats) and input-feature Jensen–Shannon divergence "
        "(bits) of every client to the union of all clients (heterogeneity.json).",
    )
    het = run.heterogeneity or {}
    kl, js = het.get("label_kl") or {}, het.get("feature_js") or {}
    if not kl and not js:
        panel.note = "No heterogeneity.json in this run directory."
        return panel
    clients = sorted(
        set(kl) | set(js), key=lambda c: (0, int(c), "") if str(c).isdigit() else (1, 0, str(c))
    )
    names = [f"client {c}" for c in clients]
    fig = go.Figure()
    if kl:
        fig.add_trace(
            go.Bar(
                x=names,
                y=[num(kl.get(c)) for c in clients],
                name="label KL",
                marker_color=PERSONAL,
                offsetgroup="kl",  # side by side with the JS bars on the second axis
            )
        )
    if js:
        fig.add_trace(
            go.Bar(
                x=names,
                y=[num(js.get(c)) for c in clients],
                name="feature JS",
                marker_color=NEW_CLIENTS,
                yaxis="y2",
                offsetgroup="js",
            )
        )
    base_layout(
        fig, height=380, x_title="client", y_title="label KL (nats)", y2_title="feature JS (bits)"
    )
    fig.update_layout(barmode="group")
    panel.figure = fig
    return panel


def resources_panel(run: RunData) -> Panel:
    panel = Panel(
        "resources",
        "Resources per round",
        "Seconds of the evaluated rounds' training (and of the monitoring itself), and the "
        "megabytes that round sent up and down.",
    )
    if not run.rounds:
        return no_rounds(panel)
    seconds = run.series("seconds", "round")
    monitor = run.series("seconds", "monitor")
    up = run.series("communication", "bytes_up_round")
    down = run.series("communication", "bytes_down_round")
    if not any(v is not None for v in seconds + up):
        panel.note = "No per-round resources recorded (an older run)."
        return panel
    fig = go.Figure()
    fig.add_trace(round_line(run, seconds, "s per round (training)", TRAIN, hover="%{y:.3g} s"))
    if any(v for v in monitor if v is not None):
        fig.add_trace(
            round_line(
                run, monitor, "s monitoring", TRAIN, dash="dot", width=1.6, hover="%{y:.3g} s"
            )
        )
    mb = {
        "up": [None if v is None else v / 1e6 for v in up],
        "down": [None if v is None else v / 1e6 for v in down],
    }
    for name, color in (("up", UP), ("down", DOWN)):
        trace = round_line(run, mb[name], f"MB {name} per round", color, hover="%{y:.3g} MB")
        trace.yaxis = "y2"
        fig.add_trace(trace)
    round_layout(fig, run, y_title="seconds", y2_title="MB")
    panel.figure = fig
    return panel


def privacy_panel(run: RunData) -> Panel:
    panel = Panel(
        "privacy",
        "Privacy budget spent",
        "Cumulative epsilon (and delta) reported by the run's privacy mechanism, per round.",
        wide=False,
    )
    eps = run.series("privacy", "epsilon")
    fig = go.Figure(round_line(run, eps, "epsilon", PERSONAL, hover="ε = %{y:.3g}"))
    round_layout(fig, run, y_title="ε")
    panel.figure = fig
    return panel


def has_privacy(run: RunData) -> bool:
    return any(v is not None for v in run.series("privacy", "epsilon"))


def secure_aggregation_panel(run: RunData) -> Panel:
    """The protocol's cost and failures: cumulative MB the clients sent and received through
    it, and the rounds that aborted (too few survivors for the threshold)."""
    kind = dig(run.summary, "secure_aggregation", "kind") or "secure aggregation"
    panel = Panel(
        "secure_aggregation",
        f"Secure aggregation ({kind})",
        "Cumulative protocol traffic (masked or encrypted inputs, keys, shares) and the rounds "
        "that aborted because too few clients survived; an aborted round leaves the model "
        "unchanged.",
        wide=False,
    )
    fig = go.Figure()
    for name, color in (("up", UP), ("down", DOWN)):
        mb = [
            None if v is None else v / 1e6
            for v in run.series("secure_aggregation", f"bytes_{name}")
        ]
        fig.add_trace(round_line(run, mb, f"MB {name}", color, hover="%{y:.3g} MB"))
    aborted = run.series("secure_aggregation", "rounds_aborted")
    trace = round_line(run, aborted, "rounds aborted", PERSONAL, dash="dot", hover="%{y:d}")
    trace.yaxis = "y2"
    fig.add_trace(trace)
    round_layout(fig, run, y_title="MB (cumulative)", y2_title="rounds aborted")
    panel.figure = fig
    return panel


def has_secure_aggregation(run: RunData) -> bool:
    return any(v is not None for v in run.series("secure_aggregation", "bytes_up"))


def attack_panel(run: RunData) -> Panel:
    """Under a poisoning attack: the benign clients' accuracy (global model on their data,
    their deployed models' mean) next to the malicious clients', and a backdoor's success."""
    kind = dig(run.summary, "attack", "kind") or "attack"
    panel = Panel(
        "attack",
        f"Under attack ({kind})",
        "Accuracy of the benign clients apart from the malicious ones (global model on the "
        "benign clients' held-out data; deployed models' mean), and the backdoor's success "
        "rate on the global model when the attack is a backdoor.",
        wide=False,
    )
    fig = go.Figure()
    lines = (
        (("attack", "benign_global", "accuracy"), "benign, global", GLOBAL, "solid"),
        (("attack", "benign_personalized_mean"), "benign, deployed", PERSONAL, "solid"),
        (("attack", "malicious_personalized_mean"), "malicious, deployed", TRAIN, "dot"),
        (("attack", "backdoor_success"), "backdoor success", DOWN, "dash"),
    )
    for keys, name, color, dash in lines:
        values = run.series(*keys)
        if any(v is not None for v in values):
            fig.add_trace(round_line(run, values, name, color, dash=dash, hover="%{y:.3f}"))
    round_layout(fig, run, y_title="rate")
    panel.figure = fig
    return panel


def has_attack(run: RunData) -> bool:
    return any(v is not None for v in run.series("attack", "malicious"))
