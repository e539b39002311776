"""Fixtures for the dashboard tests: a folder of fake run directories."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.report.fake_run import CONFIG, make_rows, make_run_dir


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    """alpha (finished, 10 evaluations), beta (running, 3), gamma (config only: starting),
    plus a folder and a file that are not runs, and a run outside the folder."""
    root = tmp_path / "runs"
    make_run_dir(root / "alpha", make_rows(10))
    ditto = {**CONFIG, "algorithm": {"name": "ditto", "lam": 0.1}}
    make_run_dir(root / "beta", make_rows(3), summary=False, config=ditto)
    (root / "gamma").mkdir()
    (root / "gamma" / "config.yaml").write_text(yaml.safe_dump(CONFIG), encoding="utf-8")
    (root / "notes").mkdir()
    (root / "notes" / "todo.txt").write_text("not a run", encoding="utf-8")
    (root / "README.txt").write_text("a file", encoding="utf-8")
    make_run_dir(tmp_path / "secret", make_rows(2))  # beside the folder: never served
    return root
