"""Overlay several runs on one offline page (``fedloom compare RUN_DIR... [--out FILE]``).

The page has one figure per quantity (global accuracy, personalized mean and P10, loss,
cumulative communication, seconds per round, the new clients' cold-start curve), each with one
line per run in the same colour throughout, and a table of the runs' summaries. It uses the
report's style (``html.CSS``) and is self-contained like ``report.html``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from html import escape
from pathlib import Path
from typing import Any

import plotly.graph_objects as go

from fedloom.errors import FedloomInputError, RunDirError
from fedloom.report import format as fmt
from fedloom.report.alerts import evaluate_alerts
from fedloom.report.figures import PERCENT, Panel, base_layout
from fedloom.report.html import CSS, chips_html, figures_html, footer_html, notes_html, page_html
from fedloom.report.rundir import (
    RunData,
    config_name,
    dig,
    final_section,
    first,
    latest,
    load_run,
    num,
)

COMPARE_FILE = "compare.html"
PALETTE = (
    "#1f5fa8",
    "#d1495b",
    "#2a9d8f",
    "#e9a23b",
    "#7b4fa8",
    "#00798c",
    "#8c564b",
    "#6c757d",
    "#bcbd22",
    "#17becf",
)
DASHES = ("solid", "dash", "dot", "dashdot")
DATA_KEYS = ("name", "num_clients", "partition", "test_fraction")
"""The ``data`` keys that must agree for runs to be compared on the same clients."""
TRAIN_KEYS = ("rounds", "clients_per_round", "local_epochs", "local_steps", "batch_size", "lr")


# --- facts about one run (also used by the dashboard's run list) ------------


@dataclass
class RunFacts:
    """What the comparison table and the dashboard's run list say about one run."""

    label: str
    algorithm: str | None
    dataset: str | None
    status: str  # "finished" (summary.json present) or "running"
    last_round: float | None
    planned_rounds: float | None
    hyperparameters: dict[str, Any]
    global_accuracy: float | None
    personalized: dict[str, float | None]
    best_personalized_mean: float | None
    total_bytes: float | None
    seconds_per_round: float | None
    cold_start: dict[float, float | None] = field(default_factory=dict)
    alerts: list[str] = field(default_factory=list)  # the rules that fired (report/alerts.py)


def hyperparameters(config: dict[str, Any]) -> dict[str, Any]:
    """The algorithm's own settings, then the training budget (null entries left out)."""
    algorithm = config.get("algorithm")
    out = (
        {k: v for k, v in (algorithm or {}).items() if k != "name" and v is not None}
        if isinstance(algorithm, dict)
        else {}
    )
    peft = config.get("peft")
    if isinstance(peft, dict):  # the PEFT strategy tells runs of one algorithm apart
        out |= {f"peft.{k}": peft[k] for k in ("kind", "share", "r", "rank_by_size") if k in peft}
    train = config.get("train")
    if isinstance(train, dict):
        out |= {k: train[k] for k in TRAIN_KEYS if train.get(k) is not None and k not in out}
    return out


def round_seconds(run: RunData) -> list[float | None]:
    """Seconds per round at each evaluated round: the engine's ``seconds.round`` where it
    wrote one, else the wall time since the previous evaluation over the rounds in between
    (None for the first evaluation, whose wall time includes the start-up)."""
    out: list[float | None] = []
    prev: tuple[float, float] | None = None
    for row in run.rounds:
        value = num(dig(row, "seconds", "round"))
        wall, rnd = num(row.get("wall_seconds")), num(row.get("round"))
        known = prev is not None and wall is not None and rnd is not None
        if value is None and known and rnd > prev[1] and wall >= prev[0]:
            value = (wall - prev[0]) / (rnd - prev[1])
        out.append(value)
        prev = (wall, rnd) if wall is not None and rnd is not None else None
    return out


def total_bytes(run: RunData) -> list[float | None]:
    """Cumulative bytes up + down at each evaluated round."""
    ups = run.series("communication", "bytes_up")
    downs = run.series("communication", "bytes_down")
    return [
        None if u is None and d is None else (u or 0.0) + (d or 0.0)
        for u, d in zip(ups, downs, strict=True)
    ]


def _run_total_bytes(run: RunData) -> float | None:
    """Bytes up + down of the whole run: summary.json, else the last evaluated round."""
    up = num(dig(run.summary, "communication", "bytes_up"))
    down = num(dig(run.summary, "communication", "bytes_down"))
    if up is not None or down is not None:
        return (up or 0.0) + (down or 0.0)
    return next((v for v in reversed(total_bytes(run)) if v is not None), None)


def _seconds_per_round(run: RunData) -> float | None:
    """summary.json's seconds per round, else wall seconds so far over the last round."""
    per_round = num(dig(run.summary, "seconds_per_round"))
    if per_round is not None:
        return per_round
    wall, last = num(latest(run, "wall_seconds")), (run.round_numbers or [None])[-1]
    return wall / last if wall is not None and last else None


def _fired_alerts(run: RunData) -> list[str]:
    """The alert rules that fired on ``run``, each once, in the order they fired."""
    return list(dict.fromkeys(a.rule for a in evaluate_alerts(run))) if run.rounds else []


def run_facts(run: RunData, label: str | None = None) -> RunFacts:
    """The summary numbers of ``run``: summary.json where present, else the latest row."""
    summary, config = run.summary, run.config
    pers = final_section(run, "personalized") or {}
    means = [v for v in run.series("personalized", "accuracy_mean") if v is not None]
    return RunFacts(
        label=label or run.run_dir.name,
        algorithm=first(dig(summary, "algorithm"), config_name(config.get("algorithm"))),
        dataset=first(dig(summary, "dataset"), config_name(config.get("data"))),
        status="running" if run.in_progress else "finished",
        last_round=(run.round_numbers or [None])[-1],
        planned_rounds=num(first(dig(summary, "rounds"), dig(config, "train", "rounds"))),
        hyperparameters=hyperparameters(config),
        global_accuracy=num((final_section(run, "global") or {}).get("accuracy")),
        personalized={
            key: num(pers.get(f"accuracy_{key}")) for key in ("mean", "p10", "p50", "p90", "min")
        },
        best_personalized_mean=max(means, default=None),
        total_bytes=_run_total_bytes(run),
        seconds_per_round=_seconds_per_round(run),
        cold_start=cold_start(run),
        alerts=_fired_alerts(run),
    )


def cold_start(run: RunData) -> dict[float, float | None]:
    """New clients' mean accuracy by adaptation steps (summary.json ``cold_start``)."""
    curve = dig(run.summary, "cold_start")
    out: dict[float, float | None] = {}
    if isinstance(curve, dict) and isinstance(curve.get("steps"), list):
        accs = curve.get("accuracy_mean")
        accs = accs if isinstance(accs, list) else []
        for i, step in enumerate(curve["steps"]):
            if num(step) is not None:
                out[float(step)] = num(accs[i]) if i < len(accs) else None
    return out


# --- loading and checking ---------------------------------------------------


def run_labels(paths: Sequence[Path]) -> list[str]:
    """Short unique names: the directory name, with its parent where two names clash."""
    names = [p.name or str(p) for p in paths]
    labels = [
        f"{p.parent.name}/{name}" if names.count(name) > 1 else name
        for p, name in zip(paths, names, strict=True)
    ]
    seen: dict[str, int] = {}
    unique = []
    for label in labels:
        seen[label] = seen.get(label, 0) + 1
        unique.append(label if seen[label] == 1 else f"{label} #{seen[label]}")
    return unique


def load_runs(run_dirs: Iterable[str | Path]) -> list[RunData]:
    """Load each run directory; raise FedloomInputError for none, a repeat, or a bad one."""
    paths = [Path(p) for p in run_dirs]
    if not paths:
        raise FedloomInputError("give at least one run directory to compare")
    seen: dict[Path, Path] = {}
    for path in paths:
        key = path.resolve()
        if key in seen:
            raise FedloomInputError(f"run directory '{path}' is given twice")
        seen[key] = path
    return [load_run(path) for path in paths]


def data_mismatches(runs: Sequence[RunData], labels: Sequence[str]) -> list[str]:
    """One line per ``data`` setting that differs between the runs."""
    lines = []
    for key in DATA_KEYS:
        values = [dig(run.config, "data", key) for run in runs]
        if any(v != values[0] for v in values[1:]):
            shown = "; ".join(
                f"{label}: {_show(v)}" for label, v in zip(labels, values, strict=True)
            )
            lines.append(f"data.{key} differs ({shown})")
    return lines


def _show(value: Any) -> str:
    """A config value in one line: ``dirichlet (alpha=0.3)`` for a mapping with a kind/name."""
    if isinstance(value, dict):
        head = next((k for k in ("kind", "name") if k in value), None)
        params = ", ".join(f"{k}={v}" for k, v in value.items() if k != head and v is not None)
        if head is None:
            return params
        return f"{value[head]} ({params})" if params else str(value[head])
    return "not set" if value is None else str(value)


# --- figures ----------------------------------------------------------------


def _style(i: int) -> tuple[str, str]:
    return PALETTE[i % len(PALETTE)], DASHES[(i // len(PALETTE)) % len(DASHES)]


def _overlay(
    key: str,
    title: str,
    caption: str,
    runs: Sequence[RunData],
    labels: Sequence[str],
    series: Callable[[RunData], tuple[list[float | None], list[float | None]]],
    *,
    y_title: str,
    x_title: str = "round",
    hover: str = "%{y:.4g}",
    percent: bool = False,
    custom: Callable[[float | None], str] | None = None,
) -> Panel:
    """One line per run of ``series(run) -> (x, y)``; runs without values are named in a note."""
    panel = Panel(key, title, caption, wide=False)
    fig = go.Figure()
    missing = []
    for i, (run, label) in enumerate(zip(runs, labels, strict=True)):
        x, y = series(run)
        if not any(v is not None for v in y):
            missing.append(label)
            continue
        color, dash = _style(i)
        trace = go.Scatter(
            x=x,
            y=y,
            name=label,
            legendgroup=label,
            mode="lines+markers" if len(x) <= 40 else "lines",
            line={"color": color, "dash": dash, "width": 2.2},
            marker={"size": 6},
            connectgaps=True,
            hovertemplate=f"{hover}<extra>{escape(label)}</extra>",
        )
        if custom is not None:
            trace.customdata = [custom(v) for v in y]
        fig.add_trace(trace)
    if not fig.data:
        panel.note = "None of the runs reported this."
        return panel
    if missing:
        panel.note = f"Not reported by: {', '.join(missing)}."
    base_layout(fig, height=380, x_title=x_title, y_title=y_title)
    fig.update_layout(hoverlabel={"namelength": -1})
    fig.update_layout(hovermode="x unified" if x_title == "round" else "closest")
    if percent:
        fig.update_yaxes(tickformat=PERCENT)
    panel.figure = fig
    return panel


def overlay_panels(runs: Sequence[RunData], labels: Sequence[str]) -> list[Panel]:
    """The comparison's figures, in page order (cold start only if a run has the curve)."""
    pct = f"%{{y:{PERCENT}}}"

    def per_round(*keys: str) -> Callable[[RunData], tuple[list, list]]:
        return lambda run: (run.round_numbers, run.series(*keys))

    def loss(run: RunData) -> tuple[list, list]:
        glob = run.series("global", "loss")
        if any(v is not None for v in glob):
            return run.round_numbers, glob
        return run.round_numbers, run.series("personalized", "loss_mean")

    def cold(run: RunData) -> tuple[list, list]:
        curve = cold_start(run)
        return list(curve), list(curve.values())

    def accuracy(key: str, title: str, caption: str, section: str, metric: str) -> Panel:
        return _overlay(
            key,
            title,
            caption,
            runs,
            labels,
            per_round(section, metric),
            y_title="accuracy",
            hover=pct,
            percent=True,
        )

    panels = [
        accuracy(
            "global_accuracy",
            "Global accuracy",
            "The global model on the pooled test data, per evaluated round.",
            "global",
            "accuracy",
        ),
        accuracy(
            "personalized_mean",
            "Personalized accuracy · mean",
            "Each client's personalized model on its own test data, averaged over clients.",
            "personalized",
            "accuracy_mean",
        ),
        accuracy(
            "personalized_p10",
            "Personalized accuracy · P10",
            "The 10th percentile over clients: how well the worst-served clients do.",
            "personalized",
            "accuracy_p10",
        ),
        _overlay(
            "loss",
            "Loss",
            "Test loss of the global model (the personalized models' mean for runs without "
            "a global model).",
            runs,
            labels,
            loss,
            y_title="loss",
        ),
        _overlay(
            "communication",
            "Cumulative communication",
            "Bytes uploaded plus downloaded since the start of the run.",
            runs,
            labels,
            lambda run: (run.round_numbers, total_bytes(run)),
            y_title="bytes up + down",
            hover="%{customdata}",
            custom=fmt.human_bytes,
        ),
        _overlay(
            "seconds",
            "Seconds per round",
            "Wall-clock time of one round (training and aggregation) at each evaluated round.",
            runs,
            labels,
            lambda run: (run.round_numbers, round_seconds(run)),
            y_title="seconds",
            hover="%{y:.3g} s",
        ),
    ]
    if panels[4].figure is not None:
        panels[4].figure.update_yaxes(tickformat="~s", ticksuffix="B", rangemode="tozero")
    if panels[5].figure is not None:
        panels[5].figure.update_yaxes(rangemode="tozero")
    curves = [cold_start(run) for run in runs]
    if any(curves):
        curve = _overlay(
            "cold_start",
            "Cold start: new clients vs adaptation steps",
            "Held-out clients (eval.new_clients), served each algorithm's way and fine-tuned "
            "on their own data: mean accuracy after each number of local steps.",
            runs,
            labels,
            cold,
            x_title="adaptation steps",
            y_title="accuracy",
            hover=f"{pct} after %{{x}} steps",
            percent=True,
        )
        if curve.figure is not None:
            steps = sorted({s for curve in curves for s in curve})
            curve.figure.update_xaxes(tickvals=steps, type="linear")
        panels.append(curve)
    return panels


# --- the summary table ------------------------------------------------------


def _hp_html(params: dict[str, Any]) -> str:
    return " ".join(
        f'<span class="hp">{escape(str(k))}={escape(_show_value(v))}</span>'
        for k, v in params.items()
    )


def _show_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, dict):
        return _show(value)
    return str(value)


def alerts_cell(rules: list[str]) -> str:
    if not rules:
        return '<span class="hint">none</span>'
    return " ".join(f'<span class="hp alert">{escape(rule)}</span>' for rule in rules)


def _status_class(status: str) -> str:
    return "done" if status == "finished" else "running"


_Column = tuple[str, str, str, Callable[[RunFacts], float | None], bool]
"""(key, title, tooltip, value of a run, higher is better / shown as a percent)."""


def _columns(steps: Sequence[float]) -> list[_Column]:
    """The numeric columns: accuracies, costs, then one per cold-start step."""
    return [
        ("global", "Global", "the global model's accuracy", lambda f: f.global_accuracy, True),
        *(
            (
                f"p_{q}",
                q.title() if q in ("mean", "min") else q.upper(),
                f"personalized accuracy, {q} over clients",
                (lambda f, q=q: f.personalized.get(q)),
                True,
            )
            for q in ("mean", "p10", "p50", "p90", "min")
        ),
        (
            "mb",
            "MB",
            "megabytes uploaded plus downloaded",
            lambda f: None if f.total_bytes is None else f.total_bytes / 1e6,
            False,
        ),
        ("spr", "s/round", "seconds per round", lambda f: f.seconds_per_round, False),
        *(
            (
                f"cold_{s:g}",
                f"@{s:g}",
                f"new clients' mean accuracy after {s:g} adaptation steps",
                (lambda f, s=s: f.cold_start.get(s)),
                True,
            )
            for s in steps
        ),
    ]


def _best(columns: Sequence[_Column], facts: Sequence[RunFacts]) -> dict[str, float | None]:
    """The best value of each column (None where fewer than two runs have one)."""
    best: dict[str, float | None] = {}
    for key, _, _, get, higher in columns:
        values = [v for v in map(get, facts) if v is not None]
        best[key] = (max if higher else min)(values) if len(values) > 1 else None
    return best


def _group_row(steps: Sequence[float]) -> str:
    """The header row above the column titles that names their groups."""
    groups = [("", 4), ("Personalized accuracy", 5), ("Cost", 2)]
    if steps:
        groups.append(("New clients · steps", len(steps)))
    groups.append(("", 1))
    return "".join(
        f'<th colspan="{n}" class="group">{escape(title)}</th>'
        if title
        else f'<th colspan="{n}"></th>'
        for title, n in groups
    )


def _run_rows(
    f: RunFacts, color: str, columns: Sequence[_Column], best: dict[str, float | None]
) -> str:
    """A run's two rows: its numbers, then its hyperparameters."""

    def cell(key: str, value: float | None, percent: bool) -> str:
        text = fmt.percent(value) if percent else fmt.MISSING if value is None else f"{value:,.2f}"
        strong = value is not None and value == best[key]
        return f'<td class="num{" best" if strong else ""}" data-col="{key}">{text}</td>'

    progress = fmt.integer(f.last_round) if f.last_round is not None else fmt.MISSING
    if f.planned_rounds is not None:
        progress += f" / {fmt.integer(f.planned_rounds)}"
    cells = "".join(cell(key, get(f), pct) for key, _, _, get, pct in columns)
    label = escape(f.label)
    width = 4 + len(columns)
    return (
        f'<tr data-run="{label}" class="main">'
        f'<td class="run"><span class="swatch" style="background:{color}"></span>{label}</td>'
        f'<td data-col="algorithm">{escape(str(f.algorithm or fmt.MISSING))}</td>'
        f'<td class="rounds" data-col="rounds"><span class="status {_status_class(f.status)}">'
        f"{escape(f.status)}</span> {escape(progress)}</td>{cells}"
        f'<td class="alerts-cell" data-col="alerts">{alerts_cell(f.alerts)}</td></tr>'
        f'<tr data-run-hps="{label}" class="hps"><td></td><td colspan="{width - 1}" '
        f'data-col="hyperparameters">{_hp_html(f.hyperparameters)}</td></tr>'
    )


def summary_table(facts: Sequence[RunFacts], colors: Sequence[str]) -> str:
    """One row per run; the best value of each numeric column is bold."""
    steps = sorted({s for f in facts for s in f.cold_start})
    columns = _columns(steps)
    best = _best(columns, facts)
    head = "".join(
        f'<th class="num" title="{escape(tip)}">{escape(title)}</th>'
        for _, title, tip, _, _ in columns
    )
    rows = [_run_rows(f, color, columns, best) for f, color in zip(facts, colors, strict=True)]
    return (
        '<section class="panel wide table"><h2>Summaries</h2>'
        '<p class="caption">Final numbers from each run\'s summary.json (the latest evaluated '
        "round for a run still in progress), with the algorithm's settings under each run. "
        "Bold: the best of each column.</p>"
        '<div class="scroll"><table class="compare">'
        f'<thead><tr class="groups">{_group_row(steps)}</tr><tr><th>Run</th><th>Algorithm</th>'
        f"<th>Rounds</th>{head}<th>Alerts</th></tr></thead>"
        f"<tbody>{''.join(rows)}</tbody></table></div></section>"
    )


# --- the page ---------------------------------------------------------------

COMPARE_CSS = """
.banner.warn { background: #fdecea; border-color: #f3b7b0; color: #8a1c12; font-weight: 500; }
.banner.warn ul { margin: 4px 0 0; padding-left: 20px; }
.scroll { overflow-x: auto; }
table.compare { border-collapse: collapse; width: 100%; font-size: 13.5px; margin: 6px 0 8px; }
table.compare th, table.compare td { padding: 6px 8px; border-bottom: 1px solid var(--line);
  text-align: left; vertical-align: top; }
table.compare th { font-size: 12px; color: var(--soft); text-transform: uppercase;
  letter-spacing: .04em; white-space: nowrap; }
table.compare td.num { text-align: right; font-variant-numeric: tabular-nums;
  white-space: nowrap; }
table.compare td.best { font-weight: 700; }
table.compare th.num { text-align: right; }
table.compare td.rounds { white-space: nowrap; }
table.compare td.run { font-weight: 600; white-space: nowrap; }
.swatch { display: inline-block; width: 10px; height: 10px; border-radius: 3px;
  margin-right: 7px; }
table.compare tr.main td { border-bottom: 0; padding-bottom: 2px; }
table.compare tr.hps td { padding-top: 0; line-height: 1.8; }
table.compare th.group { text-align: center; border-bottom: 2px solid var(--line);
  padding-bottom: 2px; }
table.compare tr.groups th { padding-top: 0; }
.hp { display: inline-block; background: #f1f4f8; border-radius: 6px; padding: 0 6px;
  margin: 1px 2px; font: 12px ui-monospace, SFMono-Regular, Menlo, monospace;
  white-space: nowrap; }
.runs-list { list-style: none; padding: 0; margin: 10px 0 0; font-size: 13px; }
.runs-list li { margin: 2px 0; color: var(--soft); word-break: break-all; }
.runs-list b { color: var(--ink); }
.hp.alert { background: #fdecec; color: #8a1c12; }
.hint { color: var(--soft); }
a.back { color: var(--accent); text-decoration: none; font-size: 13px; }
"""


def _title(facts: Sequence[RunFacts]) -> str:
    algorithms = [f.algorithm for f in facts if f.algorithm]
    if len(set(algorithms)) == len(facts) > 1:
        return " vs ".join(map(str, algorithms))
    return " vs ".join(f.label for f in facts) if len(facts) <= 4 else f"{len(facts)} runs"


def _header(
    runs: Sequence[RunData],
    facts: Sequence[RunFacts],
    colors: Sequence[str],
    title: str,
    back_href: str | None,
) -> str:
    """Title, the chips the runs share (dataset, partition) and one line per run."""
    datasets = {str(f.dataset) for f in facts}
    partitions = {_show(dig(r.config, "data", "partition")) for r in runs}
    chips = [("runs", str(len(runs)))]
    if len(datasets) == 1:
        chips.append(("dataset", datasets.pop()))
    if len(partitions) == 1:
        chips.append(("partition", partitions.pop()))
    run_list = "".join(
        f'<li><span class="swatch" style="background:{c}"></span><b>{escape(f.label)}</b> '
        f"{escape(str(r.run_dir.resolve()))}</li>"
        for f, r, c in zip(facts, runs, colors, strict=True)
    )
    back = f'<a class="back" href="{escape(back_href)}">← all runs</a>' if back_href else ""
    return (
        f'<header class="run">{back}<div class="eyebrow">fedloom comparison</div>'
        f"<h1>{escape(title)}</h1>"
        f'<div class="chips">{chips_html(chips)}</div><ul class="runs-list">{run_list}</ul>'
        "</header>"
    )


def _progress_lines(facts: Sequence[RunFacts]) -> list[str]:
    """One line per run still in progress or without an evaluated round."""
    progress = [
        f"{f.label} is still in progress (round {fmt.integer(f.last_round)}"
        + (f" of {fmt.integer(f.planned_rounds)})." if f.planned_rounds else ").")
        for f in facts
        if f.status == "running" and f.last_round is not None
    ]
    return progress + [
        f"{f.label} has no evaluated rounds yet." for f in facts if f.last_round is None
    ]


def _warnings(runs: Sequence[RunData], labels: Sequence[str], facts: Sequence[RunFacts]) -> str:
    """The banner for runs on different data, then the notes on runs not finished."""
    mismatches = data_mismatches(runs, labels)
    progress = _progress_lines(facts)
    warn_html = ""
    if mismatches:
        items = "".join(f"<li>{escape(w)}</li>" for w in mismatches)
        warn_html = (
            '<div class="banner warn" id="data-mismatch"><strong>These runs do not use the same '
            "data, so their numbers are not directly comparable.</strong>"
            f"<ul>{items}</ul></div>"
        )
    if progress:
        items = "".join(f"<li>{escape(w)}</li>" for w in progress)
        warn_html += f'<section class="notes" id="in-progress"><ul>{items}</ul></section>'
    return warn_html


def render_comparison(
    runs: Sequence[RunData],
    labels: Sequence[str] | None = None,
    *,
    plotlyjs: bool | str = True,
    back_href: str | None = None,
) -> str:
    """The whole comparison page. ``plotlyjs``: True inlines the library (offline file); a
    URL loads it from there (the dashboard). ``back_href`` adds a link back (the dashboard)."""
    labels = list(labels) if labels is not None else run_labels([r.run_dir for r in runs])
    facts = [run_facts(run, label) for run, label in zip(runs, labels, strict=True)]
    colors = [_style(i)[0] for i in range(len(runs))]
    title = _title(facts)
    notes = [
        f"{label}: {note}" for run, label in zip(runs, labels, strict=True) for note in run.notes
    ]
    body = [
        _header(runs, facts, colors, title, back_href),
        _warnings(runs, labels, facts),
        notes_html(notes),
        summary_table(facts, colors),
        figures_html(overlay_panels(runs, labels), plotlyjs),
        footer_html(offline=plotlyjs is True),
    ]
    return page_html(f"{title} · fedloom comparison", CSS + COMPARE_CSS, body)


def write_comparison(run_dirs: Iterable[str | Path], out: str | Path = COMPARE_FILE) -> Path:
    """Write the comparison page of ``run_dirs`` to ``out`` and return its path."""
    runs = load_runs(run_dirs)
    target = Path(out)
    if target.is_dir():
        target = target / COMPARE_FILE
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunDirError(f"cannot create '{target.parent}': {exc.strerror}") from None
    page = render_comparison(runs)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(page, encoding="utf-8")
        os.replace(tmp, target)
    except OSError as exc:
        raise RunDirError(f"cannot write '{target}': {exc.strerror}") from None
    finally:
        tmp.unlink(missing_ok=True)
    return target
