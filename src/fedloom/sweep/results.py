"""A sweep's outputs: ``results.csv`` (one row per run, accuracies as fractions) and the tables
over seeds, ``table.md`` and ``table.tex`` (one row per cell, accuracies in percent, mean ±
sample standard deviation over the seeds that finished; docs/benchmarks.md).

The best-over-rounds personalized mean is the largest ``personalized.accuracy_mean`` of any
evaluated round, what PFLlib's leaderboard reports (Zhang et al. 2025, "PFLlib", JMLR; its
``get_mean_std`` takes each run's best test accuracy); the final numbers are the last round's.
"""

from __future__ import annotations

import csv
import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedloom.report.compare import run_facts
from fedloom.report.rundir import dig, load_run, num

MB = 1e6
"""MB in the tables and results.csv: 10^6 bytes."""
METRIC_COLUMNS = (
    "final_global_accuracy_fraction",
    "final_personalized_mean_fraction",
    "final_personalized_p10_fraction",
    "final_personalized_p50_fraction",
    "final_personalized_p90_fraction",
    "best_personalized_mean_fraction",
    "rounds",
    "seconds_per_round",
    "mb_up",
    "mb_down",
)
TAIL_COLUMNS = ("run_dir", "status", "error")


def columns(grid_keys: Sequence[str]) -> list[str]:
    """results.csv's header: the grid keys, seed, the metrics, run_dir, status, error."""
    return [*grid_keys, "seed", *METRIC_COLUMNS, *TAIL_COLUMNS]


def run_metrics(run_dir: Path) -> dict[str, float | None]:
    """The metric columns of one finished run directory."""
    run = load_run(run_dir)
    facts = run_facts(run)
    up = num(dig(run.summary, "communication", "bytes_up"))
    down = num(dig(run.summary, "communication", "bytes_down"))
    pers = facts.personalized
    return {
        "final_global_accuracy_fraction": facts.global_accuracy,
        "final_personalized_mean_fraction": pers["mean"],
        "final_personalized_p10_fraction": pers["p10"],
        "final_personalized_p50_fraction": pers["p50"],
        "final_personalized_p90_fraction": pers["p90"],
        "best_personalized_mean_fraction": facts.best_personalized_mean,
        "rounds": facts.last_round,
        "seconds_per_round": facts.seconds_per_round,
        "mb_up": None if up is None else up / MB,
        "mb_down": None if down is None else down / MB,
    }


def _cell_text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return str(value)


def write_csv(path: Path, header: Sequence[str], rows: Sequence[dict[str, Any]]) -> None:
    """``rows`` as CSV, written to a temporary file and moved into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    with tmp.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(header))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell_text(row.get(k)) for k in header})
    tmp.replace(path)


def read_csv(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """(grid keys, rows) of a results.csv: the grid keys are the columns before ``seed``."""
    with path.open(newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        rows = list(reader)
    return header[: header.index("seed")], rows


# --- the tables over seeds ------------------------------------------------------------------


@dataclass(frozen=True)
class Column:
    """A table column: its header, the results.csv columns summed into it, how it prints."""

    header: str
    latex: str
    sources: tuple[str, ...]
    scale: float = 1.0
    decimals: int = 2


TABLE_COLUMNS = (
    Column("Global acc. (%)", r"Global acc. (\%)", ("final_global_accuracy_fraction",), 100.0),
    Column("Pers. mean (%)", r"Pers. mean (\%)", ("final_personalized_mean_fraction",), 100.0),
    Column("Pers. P10 (%)", r"Pers. P10 (\%)", ("final_personalized_p10_fraction",), 100.0),
    Column(
        "Best pers. mean (%)", r"Best pers. mean (\%)", ("best_personalized_mean_fraction",), 100.0
    ),
    Column("s/round", "s/round", ("seconds_per_round",), decimals=3),
    Column("MB sent (up+down)", "MB sent (up+down)", ("mb_up", "mb_down")),
)


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation (None for one value) of a column over seeds."""

    mean: float
    std: float | None


@dataclass(frozen=True)
class CellRow:
    """One table row: a cell's grid values, its finished and failed seeds, its statistics."""

    values: dict[str, str]
    seeds: int
    failed: int
    stats: dict[str, Stat | None]


def _value(row: dict[str, str], column: Column) -> float | None:
    parts = [row.get(source, "") for source in column.sources]
    if any(p == "" for p in parts):
        return None
    return sum(float(p) for p in parts) * column.scale


def summarize(grid_keys: Sequence[str], rows: Sequence[dict[str, str]]) -> list[CellRow]:
    """One row per cell (first-seen order) over its finished runs."""
    cells: dict[tuple[str, ...], list[dict[str, str]]] = {}
    for row in rows:
        cells.setdefault(tuple(row[k] for k in grid_keys), []).append(row)
    out = []
    for key, members in cells.items():
        finished = [r for r in members if r["status"] == "finished"]
        stats: dict[str, Stat | None] = {}
        for column in TABLE_COLUMNS:
            values = [v for r in finished if (v := _value(r, column)) is not None]
            stats[column.header] = (
                Stat(
                    statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None
                )
                if values
                else None
            )
        out.append(
            CellRow(
                dict(zip(grid_keys, key, strict=True)),
                len(finished),
                len(members) - len(finished),
                stats,
            )
        )
    return out


def _number(stat: Stat | None, decimals: int, pm: str) -> str:
    if stat is None or not math.isfinite(stat.mean):
        return "–"
    text = f"{stat.mean:.{decimals}f}"
    return text if stat.std is None else f"{text}{pm}{stat.std:.{decimals}f}"


def _seeds(row: CellRow) -> str:
    return str(row.seeds) + (f" ({row.failed} failed)" if row.failed else "")


def markdown_table(grid_keys: Sequence[str], cells: Sequence[CellRow]) -> str:
    """table.md: one row per cell, mean ± std over seeds."""

    def esc(text: str) -> str:
        return text.replace("|", r"\|")

    header = [*grid_keys, *(c.header for c in TABLE_COLUMNS), "seeds"]
    lines = [
        "| " + " | ".join(esc(h) for h in header) + " |",
        "|" + "|".join(["---"] * len(grid_keys) + ["---:"] * (len(TABLE_COLUMNS) + 1)) + "|",
    ]
    for row in cells:
        numbers = [_number(row.stats[c.header], c.decimals, " ± ") for c in TABLE_COLUMNS]
        values = [esc(row.values[k]) for k in grid_keys]
        lines.append("| " + " | ".join([*values, *numbers, _seeds(row)]) + " |")
    note = (
        "\nAccuracies in percent (results.csv holds fractions); mean ± sample standard "
        "deviation over the seeds that finished; MB = 10^6 bytes.\n"
    )
    return "\n".join(lines) + "\n" + note


LATEX_SPECIAL = {
    "\\": r"\textbackslash{}",
    "&": r"\&",
    "%": r"\%",
    "$": r"\$",
    "#": r"\#",
    "_": r"\_",
    "{": r"\{",
    "}": r"\}",
    "~": r"\textasciitilde{}",
    "^": r"\textasciicircum{}",
}


def latex_escape(text: str) -> str:
    """``text`` with LaTeX's special characters escaped for a table cell."""
    return "".join(LATEX_SPECIAL.get(ch, ch) for ch in text)


def latex_table(grid_keys: Sequence[str], cells: Sequence[CellRow]) -> str:
    """table.tex: the same table as a booktabs ``tabular`` (needs ``\\usepackage{booktabs}``)."""
    spec = "l" * len(grid_keys) + "r" * (len(TABLE_COLUMNS) + 1)
    header = [latex_escape(k) for k in grid_keys] + [c.latex for c in TABLE_COLUMNS] + ["Seeds"]
    lines = [
        "% fedloom sweep: mean $\\pm$ sample standard deviation over seeds; accuracies in percent",
        f"\\begin{{tabular}}{{{spec}}}",
        "\\toprule",
        " & ".join(header) + " \\\\",
        "\\midrule",
    ]
    for row in cells:
        numbers = []
        for c in TABLE_COLUMNS:
            text = _number(row.stats[c.header], c.decimals, r" \pm ")
            numbers.append("--" if text == "–" else f"${text}$")
        values = [latex_escape(row.values[k]) for k in grid_keys]
        lines.append(" & ".join([*values, *numbers, latex_escape(_seeds(row))]) + " \\\\")
    lines += ["\\bottomrule", "\\end{tabular}", ""]
    return "\n".join(lines)


def write_tables(results_csv: Path, out: Path) -> tuple[Path, Path]:
    """table.md and table.tex in ``out`` from ``results_csv``."""
    grid_keys, rows = read_csv(results_csv)
    cells = summarize(grid_keys, rows)
    md, tex = out / "table.md", out / "table.tex"
    md.write_text(markdown_table(grid_keys, cells), encoding="utf-8")
    tex.write_text(latex_table(grid_keys, cells), encoding="utf-8")
    return md, tex
