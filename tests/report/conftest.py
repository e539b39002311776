"""Fixtures for the report tests: fake run directories in tmp_path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.report.fake_run import MakeRun, make_rows, make_run_dir


@pytest.fixture
def make_run(tmp_path: Path) -> MakeRun:
    """Factory: ``make_run(name, rows_kwargs..., summary=..., label_histogram=...)``."""

    def factory(
        name: str = "run",
        *,
        summary: bool = True,
        label_histogram: bool = True,
        config: dict[str, Any] | None = None,
        **row_kwargs: Any,
    ) -> Path:
        rows = make_rows(**row_kwargs)
        return make_run_dir(
            tmp_path / name,
            rows,
            summary=summary,
            label_histogram=label_histogram,
            config=config,
        )

    return factory


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A finished 50-round fedavg run evaluated every 5 rounds."""
    return make_run_dir(tmp_path / "run", make_rows())
