"""Smoke test of benchmarks/reproduce/pfl_table.py: one round of two rows (the full table is a
benchmark, not a test)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "reproduce" / "pfl_table.py"


@pytest.mark.heavy(budget=75)  # measured 32 s on a loaded 2-core machine
def test_one_round_writes_the_table(tmp_path: Path, data_root) -> None:
    spec = importlib.util.spec_from_file_location("pfl_table", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.main(["--rounds", "1", "--only", "local", "fpfc", "--out", str(tmp_path)])
    assert (tmp_path / "pfl_table.md").read_text() == text
    rows = [line for line in text.splitlines() if line.startswith("| local") or "| fpfc" in line]
    assert len(rows) == 2
    local = rows[0].split("|")
    assert local[3].strip() == "-"  # local-only has no global model
    assert 0.0 < float(local[4]) <= 1.0
