"""Report panels of reinforcement-learning runs (docs/rl.md): greedy return per round for each
environment, training and unseen; the training episodes' return; and bytes exchanged. They
read the run directory only (``metrics.jsonl`` rows' ``returns`` blocks, ``summary.json``)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.colors import qualitative

from fedloom.report.figures import (
    GLOBAL,
    TRAIN,
    Panel,
    communication_panel,
    no_rounds,
    round_layout,
    round_line,
)
from fedloom.report.rundir import RunData, dig, num

RL_ENVS = ("cartpole", "acrobot")


def is_rl(run: RunData) -> bool:
    """An RL environment in the config, or an ``rl`` block in the summary."""
    return dig(run.config, "data", "name") in RL_ENVS or isinstance(dig(run.summary, "rl"), dict)


def returns_panel(run: RunData) -> Panel:
    """Mean greedy return per round in every environment: solid lines for the agents'
    training environments, dashed for the unseen ones."""
    panel = Panel(
        "rl_returns",
        "Greedy return per environment",
        "Mean undiscounted return of the deployed greedy policies (argmax action) over the "
        "evaluation episodes, per environment: solid lines are the agents' training "
        "environments, dashed lines environments no agent trained on.",
    )
    if not run.rounds:
        return no_rounds(panel)
    fig = go.Figure()
    colors = qualitative.Plotly
    names: list[tuple[str, str]] = []
    for row in run.rounds:
        for kind in ("train", "unseen"):
            for env in dig(row, "returns", kind) or {}:
                if (kind, env) not in names:
                    names.append((kind, env))
    for i, (kind, env) in enumerate(names):
        ys = run.series("returns", kind, env)
        label = env if kind == "train" else f"{env} (unseen)"
        dash = "solid" if kind == "train" else "dash"
        fig.add_trace(round_line(run, ys, label, colors[i % len(colors)], dash=dash))
    if not names:
        panel.note = "No greedy evaluation was recorded."
        return panel
    round_layout(fig, run, y_title="return", height=440)
    panel.figure = fig
    return panel


def training_panel(run: RunData) -> Panel:
    """The training episodes' mean return and the learner's loss per round."""
    panel = Panel(
        "rl_training",
        "Training episodes and loss",
        "Mean return of the episodes the agents played while training (exploring), and the "
        "learner's loss (REINFORCE's surrogate, PPO's loss or the TD error) on the right axis.",
        wide=False,
    )
    if not run.rounds:
        return no_rounds(panel)
    fig = go.Figure([round_line(run, run.series("train_return"), "training return", GLOBAL)])
    loss = round_line(run, run.series("train_loss"), "loss", TRAIN, dash="dot")
    loss.yaxis = "y2"
    fig.add_trace(loss)
    round_layout(fig, run, y_title="return", height=380, y2_title="loss")
    panel.figure = fig
    return panel


def build_panels(run: RunData) -> list[Panel]:
    return [returns_panel(run), training_panel(run), communication_panel(run)]


def headline(run: RunData) -> list[tuple[str, float | None, str]]:
    """(label, value, detail) of the report's headline cards: the final greedy return over
    the training and the unseen environments."""
    final = dig(run.summary, "final") or {}
    last = run.rounds[-1] if run.rounds else {}
    out = []
    for key, label, detail in (
        ("return_train_mean", "Greedy return · training envs", "mean over environments"),
        ("return_unseen_mean", "Greedy return · unseen envs", "environments no agent saw"),
    ):
        value = final.get(key, last.get(key))
        out.append((label, num(value), detail))
    return out
