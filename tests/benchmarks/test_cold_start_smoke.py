"""Smoke test of benchmarks/reproduce/cold_start.py: one round of one row."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "reproduce" / "cold_start.py"


def test_one_round_writes_the_curve_table(tmp_path: Path, data_root) -> None:
    spec = importlib.util.spec_from_file_location("cold_start", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = module.main(["--rounds", "1", "--only", "fedavg", "--out", str(tmp_path)])
    assert (tmp_path / "cold_start.md").read_text() == text
    (row,) = [line for line in text.splitlines() if line.startswith("| fedavg")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == "0.05"  # train.lr: FedAvg has no adaptation step size of its own
    accuracies = [float(c.split()[0]) for c in cells[2:6]]
    assert all(0.0 <= a <= 1.0 for a in accuracies)
    assert accuracies[-1] > accuracies[0]  # 20 fine-tuning steps help a 1-round global model
