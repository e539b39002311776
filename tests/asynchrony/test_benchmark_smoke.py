"""Smoke test of benchmarks/asynchrony.py: a short virtual-time budget, every method."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "asynchrony.py"


def test_a_short_budget_gives_a_curve_per_method(data_root, capsys) -> None:
    spec = importlib.util.spec_from_file_location("asynchrony_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    results = module.main(["--budget", "100", "--eval-every-time", "50"])
    assert [r["method"] for r in results] == list(module.METHODS)
    for r in results:
        assert r["clock_end"] >= 100  # each method runs past the budget
        times = [t for t, _ in r["curve"]]
        assert times == sorted(times) and all(0 <= a <= 1 for _, a in r["curve"])
    sync, fedasync, _ = results
    assert sync["staleness_mean"] == 0.0
    assert fedasync["updates"] > sync["updates"]  # no waiting for the stragglers
    out = capsys.readouterr().out
    assert "| FedBuff (K 5) |" in out
