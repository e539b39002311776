"""Smoke test of benchmarks/flower_baseline.py (fedloom against plain Flower 1.42) on a tiny
setting: 4 MNIST clients of 150 samples, 2 rounds (the full benchmark is not a test)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.ray  # run apart from the parallel tests (scripts/test.sh)

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def flower_baseline() -> Iterator[Any]:
    pytest.importorskip("flwr")
    pytest.importorskip("ray")
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import flower_baseline

        yield flower_baseline
    finally:
        sys.path.remove(str(BENCH_DIR))


def test_the_settings_of_the_issue(flower_baseline: Any) -> None:
    def args(**kw: Any) -> argparse.Namespace:
        return argparse.Namespace(**{"setting": "both", "rounds": None, "quick": False} | kw)

    small, large = flower_baseline.settings_from(args())
    assert (small.clients, small.per_round, small.batch, small.lr, small.rounds) == (
        100,
        10,
        10,
        0.1,
        20,
    )
    assert (large.clients, large.per_round, large.batch, large.lr, large.rounds) == (
        100,
        100,
        32,
        0.05,
        5,
    )
    assert [s.rounds for s in flower_baseline.settings_from(args(quick=True))] == [4, 2]
    (only,) = flower_baseline.settings_from(args(setting="large", rounds=3))
    assert only.rounds == 3


@pytest.mark.heavy(budget=90)  # a benchmark's smoke run (24 s loaded): heavy, as conftest says
def test_tiny_setting_runs_both_sides(flower_baseline: Any, data_root: Path) -> None:
    tiny = flower_baseline.Setting(
        "tiny", clients=4, per_round=4, batch=10, lr=0.1, rounds=2, train_samples=150,
        test_samples=1000,
    )  # fmt: skip
    results = flower_baseline.run([tiny], executors=("auto", "sequential"))
    entry = results["tiny"]
    assert set(entry) >= {"setting", "flower", "fedloom", "ratios", "check"}
    assert set(entry["fedloom"]) == {"auto", "sequential"}
    sides = [entry["flower"], *entry["fedloom"].values()]
    for side in sides:
        for key in ("first_round_s", "per_round_s", "whole_run_s"):
            assert side[key] > 0
        assert len(side["rounds_s"]) == 2
        assert side["accuracy"] > 0.25  # trained: chance is 0.1
    assert len({side["split"] for side in sides}) == 1  # one split on both sides
    assert entry["flower"]["whole_run_s"] > entry["flower"]["first_round_s"]
    for ratio in entry["ratios"].values():
        assert ratio["per_round"] > 0 and ratio["whole_run"] > 0
    assert "tiny" in flower_baseline.format_table(results)
    json.loads(json.dumps(results))  # the last line of the real run is this JSON
