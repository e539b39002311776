"""The sweep's one Rich progress bar: runs done of all, with how many run now, are left and
failed (the run's own bar is engine/progress.py's; a sweep's runs draw none)."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)


class SweepProgress:
    """Context manager: ``finish(failed)`` as each run ends, ``running(n)`` as runs start."""

    def __init__(self, total: int, completed: int, enabled: bool) -> None:
        self.total, self.done, self.failed, self.now = total, completed, 0, 0
        self._progress = Progress(
            TextColumn("[bold]sweep runs"),
            MofNCompleteColumn(),
            BarColumn(),
            TextColumn("{task.fields[state]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self._task = self._progress.add_task(
            "runs", total=total, completed=completed, state=self._state()
        )

    def _state(self) -> str:
        left = self.total - self.done - self.now
        failed = f", [red]{self.failed} failed[/]" if self.failed else ""
        return f"running {self.now}, left {left}{failed}"

    def __enter__(self) -> SweepProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def running(self, now: int) -> None:
        if now != self.now:
            self.now = now
            self._progress.update(self._task, state=self._state())

    def finish(self, failed: bool) -> None:
        self.done += 1
        self.failed += failed
        self.now = max(0, self.now - 1)
        self._progress.update(self._task, advance=1, state=self._state())
