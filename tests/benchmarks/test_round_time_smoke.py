"""Smoke test of benchmarks/round_time.py on tiny workloads (the full benchmark is not a test)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def round_time() -> Any:
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import round_time

        yield round_time
    finally:
        sys.path.remove(str(BENCH_DIR))


def tiny_run(round_time: Any, device: str = "cpu") -> dict[str, Any]:
    from dataclasses import replace

    tiny = [
        replace(wl, clients=5, samples=20, test_samples=5, repeats=1, warmup_clients=2)
        for wl in round_time.WORKLOADS.values()
    ]
    return round_time.run(tiny, peak_size=256, device=torch.device(device))


@pytest.mark.heavy(budget=60)  # measured 21 s on a loaded 2-core machine
def test_tiny_workloads_report_positive_times(round_time: Any) -> None:
    results = tiny_run(round_time)
    assert set(results) == {"W1", "W2", "W3"}
    for entry in results.values():
        assert entry["device"] == "cpu"
        for key in ("reference_s", "sequential_s", "vectorized_s", "best_s"):
            assert entry[key] > 0
        assert isinstance(entry["best_config"], str) and entry["best_config"]
        assert entry["peak_fraction"] > 0
        assert entry["reference_threads"] in (1, 2)
        assert entry["sequential_vs_vectorized_max_abs_diff"] < 1e-3
        evaluation = entry["evaluation"]
        for key in ("global_eval_s", "sequential_personalized_eval_s"):
            assert evaluation[key] > 0
        assert evaluation["vectorized_personalized_eval_s"] > 0
    table = round_time.format_table(results)
    assert "W3" in table and "Targets" in table
    json.loads(json.dumps(results))  # the last line of the real run is this JSON


def test_flops_of_the_2nn(round_time: Any) -> None:
    wl = round_time.WORKLOADS["W1"]
    macs = 784 * 200 + 200 * 200 + 200 * 10
    assert round_time.round_flops(wl) == 6.0 * macs * 100 * 600


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here")
def test_tiny_workloads_on_the_gpu(round_time: Any) -> None:
    """``--device cuda``: the reference, vectorized and auto rounds run on the GPU, the GPU's
    vectorized round equals the CPU's sequential one, and the times are positive."""
    results = tiny_run(round_time, "cuda")
    for entry in results.values():
        assert entry["device"] == "cuda"
        assert entry["sequential_vs_vectorized_max_abs_diff"] < 1e-3
        assert min(entry["reference_s"], entry["vectorized_s"], entry["best_s"]) > 0
