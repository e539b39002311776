"""A Rich progress bar over rounds (iterations, trees) that shows the latest evaluated metrics,
for every run family (engine/shell.py)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn


def _fmt(row: dict[str, Any]) -> str:
    parts = []
    glob = row.get("global") or {}
    pers = row.get("personalized") or {}
    if glob.get("accuracy") is not None:
        parts.append(f"global acc {glob['accuracy']:.3f}")
    elif glob.get("loss") is not None:
        parts.append(f"global loss {glob['loss']:.4g}")
    if pers.get("accuracy_mean") is not None:
        parts.append(f"pers acc {pers['accuracy_mean']:.3f} (P10 {pers['accuracy_p10']:.3f})")
    elif pers.get("loss_mean") is not None:
        parts.append(f"pers loss {pers['loss_mean']:.4g}")
    if row.get("return_mean") is not None:  # an RL run's greedy return (docs/rl.md)
        parts.append(f"return {row['return_mean']:.1f}")
    return "  ".join(parts)


class RoundProgress:
    """Context manager: ``advance()`` once per round, ``show_metrics(row)`` after evaluation."""

    def __init__(self, total: int, completed: int, enabled: bool) -> None:
        self.enabled = enabled
        self._progress = Progress(
            TextColumn("[bold]round"),
            MofNCompleteColumn(),
            BarColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[metrics]}"),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self._task = self._progress.add_task("rounds", total=total, completed=completed, metrics="")

    def __enter__(self) -> RoundProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def advance(self) -> None:
        self._progress.advance(self._task)

    def show_metrics(self, row: dict[str, Any]) -> None:
        self._progress.update(self._task, metrics=_fmt(row))
