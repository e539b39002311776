"""Smoke test of benchmarks/contention.py on a tiny round (the full benchmark is not a test):
the old policy really runs with OpenMP's spinning default, fedloom's with the passive one, and
a busy neighbour is started and stopped."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "contention.py"


@pytest.mark.heavy(budget=90)  # measured 41 s on a loaded 2-core machine
def test_tiny_round_quiet_and_beside_a_spinning_process() -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            *("--rounds", "2", "--clients", "2", "--steps", "2", "--timeout", "120"),
            *("--policies", "old,fedloom", "--backgrounds", "quiet,spin"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (out["model"], out["clients"], out["steps"]) == ("mlp", 2, 2)
    results = out["results"]
    assert set(results) == {"old", "fedloom"}
    for row in results.values():
        assert set(row) == {"quiet", "spin"}
        for r in row.values():
            assert len(r["rounds_s"]) == 2 and r["mean_s"] > 0 and r["ratio_to_quiet"] > 0
            assert r["choice"] == "sequential"
    # the old policy imports torch before fedloom (OpenMP's default), fedloom's sets PASSIVE
    assert results["fedloom"]["quiet"]["wait_env"] == "OMP_WAIT_POLICY=PASSIVE"
    assert results["old"]["quiet"]["libgomp_spincount"] == "300000"
    assert results["fedloom"]["quiet"]["libgomp_spincount"] == "0"
