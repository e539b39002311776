"""Read a run directory (config, metrics, summary, label histogram) tolerantly."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedloom.core.files import read_yaml_mapping
from fedloom.core.run_files import Summary, type_problem
from fedloom.core.runpaths import refuse_links, under
from fedloom.errors import RunDirError

CONFIG_FILE = "config.yaml"
METRICS_FILE = "metrics.jsonl"
SUMMARY_FILE = "summary.json"
LABEL_HISTOGRAM_FILE = "label_histogram.json"
HETEROGENEITY_FILE = "heterogeneity.json"
REQUIRED_FILES = (CONFIG_FILE, METRICS_FILE)


def dig(obj: Any, *keys: str) -> Any:
    """``obj[k1][k2]...``, or None as soon as a level is missing or not a mapping."""
    for key in keys:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def num(value: Any) -> float | None:
    """``value`` as a finite float, or None (null, bool, string, NaN, inf)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


@dataclass
class LabelHistogram:
    """Per-client sample counts per class (rows: clients, columns: classes)."""

    client_names: list[str]
    counts: list[list[float]]

    @property
    def num_classes(self) -> int:
        return max((len(row) for row in self.counts), default=0)


@dataclass
class RunData:
    """Everything the report shows, with problems collected in ``notes``."""

    run_dir: Path
    config: dict[str, Any]
    rounds: list[dict[str, Any]]
    summary: dict[str, Any] | None
    label_histogram: LabelHistogram | None
    notes: list[str] = field(default_factory=list)
    heterogeneity: dict[str, Any] | None = None
    """heterogeneity.json: per-client label KL and feature JS to the pooled data, and test-set
    sizes."""

    @property
    def in_progress(self) -> bool:
        return self.summary is None

    def series(self, *keys: str) -> list[float | None]:
        """One value per evaluated round (None where missing or not a number)."""
        return [num(dig(row, *keys)) for row in self.rounds]

    @property
    def round_numbers(self) -> list[float]:
        return [float(row["round"]) for row in self.rounds]


def first(*values: Any) -> Any:
    """The first value that is neither None nor empty."""
    return next((v for v in values if v is not None and v != ""), None)


def config_name(value: Any) -> Any:
    """A config entry that is either a plain name or a mapping with a name/kind."""
    if isinstance(value, dict):
        return first(value.get("name"), value.get("kind"))
    return value


def final_section(run: RunData, section: str) -> dict[str, Any] | None:
    """``summary.final[section]``, else the section of the last round that has one."""
    value = dig(run.summary, "final", section)
    if isinstance(value, dict):
        return value
    for row in reversed(run.rounds):
        if isinstance(row.get(section), dict):
            return row[section]
    return None


def latest(run: RunData, *keys: str) -> Any:
    """The last round's value at ``keys`` that is not None."""
    for row in reversed(run.rounds):
        value = dig(row, *keys)
        if value is not None:
            return value
    return None


def load_run(run_dir: str | Path) -> RunData:
    """Load ``run_dir``; raise RunDirError if it or a required file is missing, or if it
    holds a symbolic link (core/runpaths.py)."""
    path = Path(run_dir)
    if not path.is_dir():
        what = "is not a directory" if path.exists() else "does not exist"
        raise RunDirError(f"run directory '{path}' {what}")
    refuse_links(path)
    missing = [name for name in REQUIRED_FILES if not under(path, name).is_file()]
    if missing:
        raise RunDirError(
            f"run directory '{path}' has no {' and no '.join(missing)}; "
            "is it the output directory of a fedloom run?"
        )
    notes: list[str] = []
    config = _load_config(under(path, CONFIG_FILE))
    rounds = _load_metrics(under(path, METRICS_FILE), notes)
    summary = _typed(_load_json_mapping(under(path, SUMMARY_FILE), notes), SUMMARY_FILE, notes)
    histogram = _load_label_histogram(under(path, LABEL_HISTOGRAM_FILE), notes)
    heterogeneity = _load_json_mapping(under(path, HETEROGENEITY_FILE), notes)
    return RunData(path, config, rounds, summary, histogram, notes, heterogeneity)


def _load_config(path: Path) -> dict[str, Any]:
    return read_yaml_mapping(path)


def _load_metrics(path: Path, notes: list[str]) -> list[dict[str, Any]]:
    """Rows sorted by round; a later row for the same round (resume) wins."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as exc:
        raise RunDirError(f"cannot read '{path}': {exc}") from exc
    by_round: dict[float, dict[str, Any]] = {}
    bad: list[int] = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            bad.append(lineno)
            continue
        round_no = num(row.get("round")) if isinstance(row, dict) else None
        if round_no is None:
            bad.append(lineno)
            continue
        by_round[round_no] = row
    if bad:
        shown = ", ".join(map(str, bad[:5])) + (" ..." if len(bad) > 5 else "")
        notes.append(f"{METRICS_FILE}: skipped {len(bad)} unreadable line(s) ({shown}).")
    return [by_round[key] for key in sorted(by_round)]


def _load_json_mapping(path: Path, notes: list[str]) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        notes.append(f"{path.name}: unreadable ({exc}); ignored.")
        return None
    if not isinstance(data, dict):
        notes.append(f"{path.name}: not a JSON object; ignored.")
        return None
    return data


def _typed(summary: dict[str, Any] | None, name: str, notes: list[str]) -> dict[str, Any] | None:
    """``summary`` when its keys have their types (core/run_files.py), else None and a note
    naming the key: the page shows the rounds, as for a run still in progress."""
    problem = type_problem(summary, Summary) if summary is not None else None
    if problem is not None:
        notes.append(f"{name}: {problem}; ignored.")
        return None
    return summary


def _load_label_histogram(path: Path, notes: list[str]) -> LabelHistogram | None:
    data = _load_json_mapping(path, notes)
    if data is None:
        return None
    counts = data.get("counts")
    if not isinstance(counts, list) or not all(isinstance(r, list) for r in counts):
        notes.append(f"{path.name}: 'counts' is not a list of lists; heatmap omitted.")
        return None
    rows = [[num(v) or 0.0 for v in row] for row in counts]
    if not rows or not any(rows):
        notes.append(f"{path.name}: no counts; heatmap omitted.")
        return None
    width = max(len(row) for row in rows)
    if any(len(row) != width for row in rows):
        notes.append(f"{path.name}: rows have different lengths; padded with zeros.")
        rows = [row + [0.0] * (width - len(row)) for row in rows]
    names = data.get("client_names")
    if not isinstance(names, list) or len(names) != len(rows):
        names = [f"client {i}" for i in range(len(rows))]
    return LabelHistogram([str(n) for n in names], rows)
