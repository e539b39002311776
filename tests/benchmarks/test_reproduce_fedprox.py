"""Smoke test of benchmarks/reproduce/fedprox_synthetic.py: 2 rounds, one dataset, one straggler
level (the full reproduction is not a test)."""

from __future__ import annotations

import csv
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "reproduce" / "fedprox_synthetic.py"


@pytest.fixture(scope="module")
def repro() -> ModuleType:
    spec = importlib.util.spec_from_file_location("fedprox_synthetic", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def test_two_rounds_write_table_and_curves(repro: ModuleType, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--rounds", "2", "--datasets", "1_1", "--stragglers", "0.5", "--out", str(out)]
    results = repro.main([*argv, "--executor", "sequential"])
    labels = [m.label for m in repro.methods(repro.DEFAULT_MU)]
    assert labels == ["FedAvg", "FedProx (μ=0)", "FedProx (μ=1)"]

    table_md = (out / "table.md").read_text(encoding="utf-8")
    html = (out / "curves.html").read_text(encoding="utf-8")
    with (out / "table.csv").open(newline="", encoding="utf-8") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["method"] for r in rows] == labels
    assert {r["dataset"] for r in rows} == {"Synthetic(1,1)"}
    assert {r["stragglers"] for r in rows} == {"50%"}
    for label in labels:
        assert f"| {label} |" in table_md
        assert label in html
    assert "Synthetic(1,1)" in html and "50% stragglers" in html
    assert "Plotly.newPlot" in html and "<script src=" not in html  # offline: plotly.js inlined
    assert "claims per cell" in table_md and "per local step" in table_md

    runs = results["runs"]
    assert len(runs) == 3
    for run in runs:
        run_dir = Path(run["run_dir"])
        assert (run_dir / "report.html").is_file()
        assert 1 <= len(list((run_dir / "checkpoints").glob("round_*.json"))) <= 2
        curves = run["curves"]
        assert curves["round"] == [0, 1, 2]
        assert all(0 < v < 20 for v in curves["global_train_loss"])
        assert all(0 <= v <= 1 for v in curves["global_test_accuracy"])
        train = run["config"]["train"]
        assert (train["local_epochs"], train["batch_size"], train["lr"]) == (20, 10, 0.01)
        assert train["clients_per_round"] == 10 and train["stragglers"] == 0.5
    modes = {r["method"]: r["config"]["train"]["straggler_mode"] for r in runs}
    assert modes == {"fedavg": "drop", "fedprox_mu0": "partial", "fedprox_mu": "partial"}
    # every run starts from the same initial model
    assert len({r["curves"]["global_train_loss"][0] for r in runs}) == 1

    again = repro.main([*argv, "--executor", "sequential"])  # finished cells are reused
    assert again["total"]["reused"] == 3
    assert again["rows"] == results["rows"]


def test_rejects_unknown_dataset(repro: ModuleType) -> None:
    with pytest.raises(SystemExit):
        repro.parse_args(["--datasets", "2_2"])
